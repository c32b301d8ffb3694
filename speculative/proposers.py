"""Proposers: the drafts of speculative decoding, run by the engine's model runner.

Before each step the scheduler asks ``Speculator.plan`` (the controller, ``speculative.controller``)
for every decoding sequence's draft length ``gamma``, 0 included; when all are 0 the step decodes
plainly. A round for a batch of decoding sequences (those with ``gamma`` 0 join verification with
their pending token; with early exit they also run draft pass 0, whose hidden states verification
continues from):

1. ``gamma + 1`` draft passes, one position at a time (the pending token, then each draft), write
   the draft's K/V into the sequence's own blocks and propose the next token; the last pass only
   completes the last draft's K/V. A greedy sequence's draft of a token that would end it is left
   out and its drafting stops there: the target's own token at that position decides the end.
2. One target pass over all ``gamma + 1`` positions yields the target's logits for each of them.
3. ``speculative.verification`` accepts a prefix of the drafts and adds one target token. The
   engine truncates the table to the accepted positions, so rejected K/V is never read and never
   enters the radix tree.

Every draft pass, verification pass and plain decoding pass is timed and told to the controller
with its rows, sequences and context: a verification pass up to the end of the engine's work on
its verdicts (``round_applied``), as a plain pass is timed through the same work; a pass in which
a packed layer built a kernel for a new row count is not told (it takes far longer than the next
of its shape).

Two drafts:

* **Early exit** (``EarlyExitSpeculator``): the target's first ``k`` layers and its shared final norm
  and LM head. The draft passes *are* the target's lower layers, writing the target's own K/V, and
  verification runs only layers ``[k, L)`` from the saved layer-``k`` hidden states: no position's
  lower layers are computed twice and the draft needs no K/V of its own (zero extra blocks). A
  round in which no sequence kept a draft verifies on pass 0's plan (the same rows and context).
* **Draft model** (``DraftModelSpeculator``): a separate small model with the same tokenizer whose
  K/V live in a second store of the same blocks (one block table, two physical stores). It runs on
  prompt chunks while the controller has lately been running rounds, and otherwise fills in what
  it skipped in one catch-up pass when its sequence next drafts; the cache counts, per block, the
  leading slots whose draft K/V is current (``KVCache.draft_slots``), so a prefix-cache hit serves
  the draft as far as those reach and no further.

Invariant: every verdict is what the target alone would produce (greedy: the same tokens;
sampling: the same distribution), whatever the draft proposed.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING, Callable

import torch

from cache import KVCache
from mmkv.attention.metadata import next_position
from mmkv.host_arrays import longs
from mmkv.models.packed_linear import kernel_builds
from mmkv.penalties import adjust_draft_rows
from mmkv.sampler import draw, row_probs, top_tokens
from mmkv.structured import apply_draft_masks
from mmkv.step_context import StepContext
from speculative.acceptance import DraftHistory, regime
from speculative.config import SpeculativeConfig
from speculative.controller import DraftLengthController
from speculative.costs import PassCosts
from speculative.verification import Verdict, greedy_verdict, verify_sampling

if TYPE_CHECKING:
    from mmkv.models import ModelAdapter
    from mmkv.sequence import Sequence

ContextFn = Callable[..., StepContext]  # (seqs, q_lens, kv_lens, images=True): the runner's step context
Proposal = Callable[["Sequence", int], int]  # (sequence, draft pass) -> the token to propose


@dataclass(slots=True)
class SpeculationStats:
    """Counters over every round: ``rounds`` counts sequences verified (one per sequence per
    round, those that drafted 0 included), ``drafted`` and ``accepted`` draft tokens."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    target_passes: int = 0  # passes through the target's upper layers (verification)

    def as_dict(self) -> dict[str, float]:
        return {"spec_rounds": self.rounds, "spec_drafted_tokens": self.drafted,
                "spec_accepted_tokens": self.accepted,
                "spec_acceptance_rate": round(self.accepted / self.drafted, 4) if self.drafted else 0.0,
                "spec_mean_tokens_per_round": round((self.accepted + self.rounds) / self.rounds, 4)
                if self.rounds else 0.0}


class Speculator(ABC):
    """Guarantees: every verdict is what the target alone would produce (greedy: the same
    tokens; sampling: the same distribution)."""

    every_sequence_drafts = True  # a round's sequences that draft 0 still run draft pass 0

    def __init__(self, model: ModelAdapter, config: SpeculativeConfig, context: ContextFn,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.model, self.config, self.context = model, config, context
        self.stats = SpeculationStats()
        self.controller = DraftLengthController(config.num_tokens, config.draft_length == "fixed", clock,
                                                settings=config.settings)
        self._previous: tuple[tuple[int, ...], StepContext] | None = None  # the last draft pass
        self._proposal: Proposal | None = None  # ``propose_with``'s stand-in for the draft's tokens
        self._verification: tuple[int, int, tuple[float, int], int] | None = None  # to time
        self._step: tuple[float, int] | None = None  # when the engine's step began (``step_started``)

    def keep_costs_only(self) -> None:
        """Forget everything learned and counted but the pass costs (after the engine's
        calibration): a fresh controller on the same settings with the old one's cost fits."""
        old = self.controller
        self.controller = DraftLengthController(old.positions, old.fixed, old.clock, old.settings, old.costs)
        self.stats, self._proposal, self._previous = SpeculationStats(), None, None

    def forget_pass_costs(self) -> None:
        """Learn the pass costs afresh, keeping what was learned of acceptance and output lengths
        (the engine's passes have moved to another thread count, so every cost has changed)."""
        self.controller.costs = PassCosts()

    def propose_with(self, proposal: Proposal | None) -> None:
        """Measure with given drafts: every draft token is ``proposal(seq, draft_pass)`` instead of
        the draft's, while every pass still runs and is paid for (``None``: the draft's own again).
        The engine's calibration proposes a fixed token, so every scripted pass runs;
        ``bench spec --all-accepted`` proposes the target's own greedy tokens, so every draft is
        accepted (greedy sequences only: verifying a sampled sequence needs tokens drawn from
        the draft's distribution)."""
        self._proposal = proposal

    def follow(self, input_ids: torch.Tensor, step: StepContext, seqs: list[Sequence],
               q_lens: list[int]) -> None:
        """Called after every plain target pass on the same tokens (draft stores stay in step)."""

    def catches_up_prompts(self, seqs: list[Sequence], gammas: list[int]) -> bool:
        """Whether a round with draft lengths ``gammas`` runs the draft over prompt tokens it
        has not computed (a prompt's work, not a decoding step's)."""
        return False

    @abstractmethod
    def _draft_pass(self, seqs: list[Sequence], tokens: list[int], kv_lens: list[int],
                    drafting: list[int], live: list[int]) -> torch.Tensor | None:
        """Run the draft on one position per sequence (``live``: their indices in the round);
        logits of the rows in ``drafting``."""

    @abstractmethod
    def _verify_logits(self, seqs: list[Sequence], gammas: list[int], drafts: list[list[int]],
                       lens: list[int]) -> torch.Tensor:
        """The target's logits at the ``gamma + 1`` positions of every sequence, packed."""

    def plan(self, seqs: list[Sequence], max_model_len: int, beside_prompts: bool = False) -> list[int]:
        """Each sequence's draft length for the next round (the controller's choice; all 0:
        decode plainly), at most ``num_tokens`` and one less than the tokens it may still
        generate (its ``max_tokens``, and ``max_model_len`` positions in all); ``beside_prompts``:
        the step also carries prompt chunks. What it may still generate is read only for a step
        that does not keep a held plain decision."""
        known: list[list[int]] = []

        def left() -> list[int]:
            if not known:
                known.append([min(s.params.max_tokens - s.num_generated, max_model_len - len(s.token_ids))
                              for s in seqs])
            return known[0]

        return self.controller.decide(
            [self._history(s) for s in seqs],
            lambda: [max(0, min(self.config.num_tokens, n - 1)) for n in left()],
            lambda: ([len(s.token_ids) for s in seqs],
                     [(s.num_generated, n) for s, n in zip(seqs, left())], self._behind(seqs)),
            beside_prompts)

    def finished(self, generated: int) -> None:
        """A sequence ended by itself (a stop token or string) after generating ``generated``
        tokens: the controller's estimate of where running sequences end learns from it (one
        cut short at its token limit says only that it ran that far, and the limit is known)."""
        self.controller.lengths.record(generated)

    def _behind(self, seqs: list[Sequence]) -> list[int] | None:
        """For each sequence, the positions its draft must fill in before it can draft (None: a
        draft never falls behind)."""
        return None

    def started(self) -> tuple[float, int]:
        """A pass starts now: the controller's clock and ``kernel_builds()``, for ``observe``."""
        return self.controller.clock(), kernel_builds()

    def step_started(self) -> None:
        """The engine's step starts now: its scheduling (a round's slot reservations, the
        controller's own pricing) is part of what the step's target pass costs, so a plain step
        alone is timed from here, and a round's verification with the seconds from here to the
        round's start added (``step_start``)."""
        self._step = self.started()

    def step_start(self) -> tuple[float, int]:
        """When the step began (``step_started``; now, where no step told it)."""
        step, self._step = self._step, None
        return self.started() if step is None else step

    def observe(self, kind: str, rows: int, context: int, started: tuple[float, int],
                sequences: int | None = None) -> None:
        """Tell the controller what a pass begun at ``started`` took, unless a packed layer built
        a kernel in it (a row count met for the first time: such a pass takes far longer than
        the next of its shape, and would teach the cost fit a row slope that plain steps never
        correct)."""
        if kernel_builds() == started[1]:
            self.controller.observe_pass(kind, rows, context, self.controller.clock() - started[0],
                                         sequences)

    def summary(self) -> dict[str, float]:
        return {**self.stats.as_dict(), **self.controller.summary()}

    @torch.inference_mode()
    def round(self, seqs: list[Sequence], gammas: list[int],
              stop_tokens: list[set[int]]) -> list[Verdict]:
        """Draft up to ``gammas[i]`` tokens for each sequence (0: it joins verification with its
        pending token only) and verify them. Each table must have slots reserved up to
        ``len(token_ids) + gammas[i] - 1``. A sequence drafts nothing after one of its
        ``stop_tokens`` (it would end there); a greedy one leaves that token out, so it costs no
        pass and no verified row (the target's own token there ends the sequence or not), while a
        sampled one's is verified as drawn (left out, the sequence would end less often than the
        target's chance). Every pass is timed for the controller, the verification up to
        ``round_applied``."""
        controller, self._verification = self.controller, None
        scheduled = self.controller.clock() - self.step_start()[0]  # the step's scheduling
        lens = [len(s.token_ids) for s in seqs]
        chosen, gammas = list(gammas), list(gammas)
        inputs = [s.token_ids[-1] for s in seqs]
        drafts: list[list[int]] = [[] for _ in seqs]
        draft_probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        unsure = [False] * len(seqs)  # drafting stopped below the confidence threshold
        threshold = self.config.adaptive_threshold
        drafting_seqs = [b for b in range(len(seqs)) if gammas[b] or self.every_sequence_drafts]
        self._begin([seqs[b] for b in drafting_seqs])
        for i in range(max(gammas) + 1):
            live = [b for b in drafting_seqs if i <= gammas[b]]
            if not live:  # every sequence stopped drafting early
                break
            start = self.started()
            drafting = [r for r, b in enumerate(live) if i < gammas[b]]
            logits = self._draft_pass([seqs[b] for b in live], [inputs[b] for b in live],
                                      [lens[b] + i for b in live], drafting, live)
            drafted = _draft([seqs[live[r]] for r in drafting], logits, threshold is not None)
            if self._proposal is not None:  # the pass ran and is paid for; its tokens are replaced
                drafted = [(self._proposal(seqs[live[r]], i), probs, 1.0)
                           for r, (_, probs, _) in zip(drafting, drafted)]
            for r, (token, probs, confidence) in zip(drafting, drafted):
                b = live[r]
                if threshold is not None and confidence < threshold:
                    gammas[b] = i  # not confident: this pass was the last one needed
                    unsure[b] = True
                    continue
                ends = token in stop_tokens[b]
                if ends and seqs[b].params.greedy:  # the target's own token here ends it or not
                    gammas[b] = i
                    continue
                drafts[b].append(token)
                draft_probs[b].append(probs)
                inputs[b] = token
                if ends:
                    gammas[b] = i + 1  # one more pass completes this draft's K/V
            self.observe("draft" if i else "first_draft", len(live), sum(lens[b] + i for b in live),
                         start)
        start = self.started()
        logits = self._verify_logits(seqs, gammas, drafts, lens)
        starts = [0, *accumulate(g + 1 for g in gammas)][:-1]
        adjust_draft_rows(logits, starts, seqs, drafts)  # penalties, then logit biases and structured outputs
        for seq, first, d in zip(seqs, starts, drafts):
            if seq.params.constrained:
                apply_draft_masks(logits, first, seq.constraint, seq.params.logit_bias, d)
        best = top_tokens(logits)[0]  # the greedy sequences' verdicts read one argmax
        sampled = [(b, r) for b, seq in enumerate(seqs) if not seq.params.greedy
                   for r in range(starts[b], starts[b] + gammas[b] + 1)]  # filtered together
        probs = (row_probs(logits[[r for _, r in sampled]], [seqs[b].params for b, _ in sampled])
                 if sampled else None)
        verdicts, row, first = [], 0, 0  # ``first``: a sampled sequence's first row of ``probs``
        for seq, g, d, q in zip(seqs, gammas, drafts, draft_probs):
            row += g + 1
            if seq.params.greedy:
                verdicts.append(greedy_verdict(d, best[row - g - 1:row]))
            else:
                p = probs[first:first + g + 1]
                first += g + 1
                verdicts.append(verify_sampling(d, torch.stack(q).cpu() if q else p[:0], p, seq.generator))
        self._verification = (row, sum((g + 1) * n + g * (g + 1) // 2 for n, g in zip(lens, gammas)),
                              (start[0] - scheduled, start[1]), len(seqs))
        for seq, n, c, d, v, u in zip(seqs, lens, chosen, drafts, verdicts, unsure):
            controller.observe_round(self._history(seq), c, len(d), v.accepted, u)
            if c or self.every_sequence_drafts:
                self._drafted_through(seq, n - 1, n + v.accepted)  # the pending token, accepted drafts
        self.stats.rounds += len(seqs)
        self.stats.drafted += sum(gammas)
        self.stats.accepted += sum(v.accepted for v in verdicts)
        self.stats.target_passes += 1
        return verdicts

    def round_applied(self) -> None:
        """The caller has applied the last round's verdicts (appended the tokens, truncated the
        tables, finished the sequences that ended): its verification is timed through here, as a
        plain step is timed through the same work."""
        if self._verification is not None:
            rows, context, start, sequences = self._verification
            self._verification = None
            self.observe("verify", rows, context, start, sequences)

    def _history(self, seq: Sequence) -> DraftHistory:
        if seq.drafting is None:
            seq.drafting = self.controller.new_history(regime(seq.params.temperature, seq.params.top_p))
        return seq.drafting

    def _begin(self, seqs: list[Sequence]) -> None:
        """A round starts for ``seqs``."""
        self._previous = None

    def _drafted_through(self, seq: Sequence, start: int, end: int) -> None:
        """The draft's K/V of positions ``[start, end)`` of ``seq`` is current, and so is all
        before ``start``."""
        seq.draft_valid = end

    def _draft_context(self, seqs: list[Sequence], kv_lens: list[int], live: list[int],
                       images: bool) -> StepContext:
        """The step context of a draft pass (one position per sequence). While the same sequences
        go on drafting, the previous pass's is moved on a position (planned afresh where a page
        starts) and its cross-attention plan reused: generated positions see what the last prompt
        token sees."""
        key = tuple(live)
        if self._previous is not None and self._previous[0] == key:
            last = self._previous[1]
            batch = next_position(last.batch)
            step = (last.next_position(batch) if batch is not None
                    else self.context(seqs, [1] * len(seqs), kv_lens, images=False))
            step.cross = last.cross
        else:
            step = self.context(seqs, [1] * len(seqs), kv_lens, images=images)
        self._previous = (key, step)
        return step


class EarlyExitSpeculator(Speculator):
    """The target's first ``k`` layers draft; verification runs layers ``[k, L)`` only."""

    def __init__(self, model: ModelAdapter, config: SpeculativeConfig, context: ContextFn) -> None:
        super().__init__(model, config, context)
        k = config.early_exit_layer if config.early_exit_layer is not None else model.early_exit_layer
        if k is None or not 0 < k < model.num_layers:
            raise ValueError(f"early exit needs a layer in [1, {model.num_layers}); set "
                             f"SpeculativeConfig.early_exit_layer (got {k})")
        self.k = k
        self.hidden: list[list[torch.Tensor]] = []

    def _begin(self, seqs: list[Sequence]) -> None:
        super()._begin(seqs)
        self.hidden = [[] for _ in seqs]

    def _draft_pass(self, seqs, tokens, kv_lens, drafting, live):
        step = self._draft_context(seqs, kv_lens, live, images=True)
        ids = longs(tokens, step.batch.positions.device)
        h = self.model.run_layers(self.model.embed(ids, step), step, 0, self.k)[0]
        for r, b in enumerate(live):
            self.hidden[b].append(h[r])
        if not drafting:
            return None
        return self.model.logits(h if len(drafting) == len(live) else h[drafting])

    def _verify_logits(self, seqs, gammas, drafts, lens):
        if any(gammas):
            step = self.context(seqs, [g + 1 for g in gammas], [n + g for n, g in zip(lens, gammas)])
        else:  # nothing drafted: only pass 0 ran, on the same rows and context, so its plan serves
            step = self._previous[1]
        h = torch.stack([x for per_seq in self.hidden for x in per_seq])[None]
        return self.model.logits(self.model.run_layers(h, step, self.k)[0])


class DraftModelSpeculator(Speculator):
    """A separate small model drafts from its own store of the same blocks. A round's
    sequences that draft 0 only join verification: the draft neither catches them up nor reads
    their pending token (it falls behind, as on a plain step)."""

    every_sequence_drafts = False

    def __init__(self, model: ModelAdapter, draft: ModelAdapter, kv: KVCache,
                 config: SpeculativeConfig, context: ContextFn) -> None:
        super().__init__(model, config, context)
        if draft.vocab_size != model.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({draft.vocab_size}) differs from the "
                             f"target's ({model.vocab_size}); they must share a tokenizer")
        self.draft = draft
        self.kv = kv  # its storage's second store is the draft's (read afresh: a resize replaces it)

    @property
    def draft_layers(self) -> list[torch.Tensor]:
        return self.draft.layer_views(self.kv.storage.stores[1])

    def follow(self, input_ids, step, seqs, q_lens):
        """Prompt chunks run through the draft too while the controller has lately been running
        rounds (``drafting_lately``); otherwise, and on pure decoding passes, the draft falls
        behind and catches up in one pass when its sequence next joins a round (``_catch_up``),
        so a workload the controller decodes plainly never pays for the draft's prefill. Where a
        chunk follows positions the draft has not computed (a cached prefix whose blocks hold no
        draft K/V), the draft runs one catch-up pass through the chunk's end instead."""
        if all(q == 1 for q in q_lens):
            return
        for seq in seqs:
            self._watermark(seq)  # what its blocks held before this chunk
        if not self.controller.drafting_lately():
            return
        if any(s.draft_valid < s.num_computed for s in seqs):
            self._catch_up(seqs, [s.num_computed + q for s, q in zip(seqs, q_lens)])
            return
        self._forward_draft(input_ids, step)
        for seq, q in zip(seqs, q_lens):
            self._drafted_through(seq, seq.num_computed, seq.num_computed + q)

    def _behind(self, seqs: list[Sequence]) -> list[int]:
        return [len(s.token_ids) - 1 - self._watermark(s) for s in seqs]

    def catches_up_prompts(self, seqs, gammas):
        return any(g and self._watermark(s) < s.prompt_len for s, g in zip(seqs, gammas))

    def _watermark(self, seq: Sequence) -> int:
        """Positions below which the draft's K/V of ``seq`` is current; for a sequence with a new
        table, what the cache says its blocks hold."""
        if seq.draft_valid is None:
            seq.draft_valid = self.kv.draft_written_prefix(seq.table, seq.num_computed)
        return seq.draft_valid

    def _drafted_through(self, seq: Sequence, start: int, end: int) -> None:
        super()._drafted_through(seq, start, end)
        self.kv.mark_draft_written(seq.table, start, end)

    def _begin(self, seqs: list[Sequence]) -> None:
        super()._begin(seqs)
        self._catch_up(seqs)

    def _catch_up(self, seqs: list[Sequence], ends: list[int] | None = None) -> None:
        """The draft's K/V for the positions it has not computed up to ``ends`` (by default
        all but each sequence's pending token, which pass 0 computes), in one pass."""
        if ends is None:
            ends = [len(s.token_ids) - 1 for s in seqs]
        behind = [(s, v, e) for s, e in zip(seqs, ends) if (v := self._watermark(s)) < e]
        if not behind:
            return
        step = self.context([s for s, _, _ in behind], [e - v for _, v, e in behind],
                            [e for _, _, e in behind], images=False)
        ids = longs([t for s, v, e in behind for t in s.token_ids[v:e]], step.batch.positions.device)
        start = self.started()
        self._forward_draft(ids, step)
        attended = sum(e * (e + 1) - v * (v + 1) for _, v, e in behind) // 2
        self.observe("catch_up", ids.shape[0], attended, start, len(behind))
        for seq, valid, end in behind:
            self._drafted_through(seq, valid, end)

    def _forward_draft(self, ids: torch.Tensor, step, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The draft model over ``step``'s batch in its own store: logits of ``rows`` (none when
        only its K/V is wanted)."""
        if rows is None:
            rows = torch.zeros(0, dtype=torch.long, device=ids.device)
        return self.draft.forward(ids, step.with_layers(self.draft_layers), rows)

    def _draft_pass(self, seqs, tokens, kv_lens, drafting, live):
        step = self._draft_context(seqs, kv_lens, live, images=False)  # the draft reads text only
        ids = longs(tokens, step.batch.positions.device)
        return self._forward_draft(ids, step, longs(drafting, ids.device))

    def _verify_logits(self, seqs, gammas, drafts, lens):
        step = self.context(seqs, [g + 1 for g in gammas], [n + g for n, g in zip(lens, gammas)])
        ids = longs([t for s, d in zip(seqs, drafts) for t in [s.token_ids[-1], *d]],
                    step.batch.positions.device)
        every = torch.arange(ids.shape[0], device=ids.device)
        return self.model.forward(ids, step, every)


def _draft(seqs: list[Sequence], logits: torch.Tensor,
           need_confidence: bool) -> list[tuple[int, torch.Tensor | None, float | None]]:
    """Each row's drafted token, the distribution it was drawn from (verification needs it for
    sampled sequences only) and, if ``need_confidence``, that distribution's top probability.
    The greedy rows are drafted together (one ``top_tokens`` call gives both the tokens and their
    probabilities), and so are the sampled ones (``row_probs``, ``draw``)."""
    out: list[tuple[int, torch.Tensor | None, float | None]] = [(0, None, None)] * len(seqs)
    greedy = [row for row, s in enumerate(seqs) if s.params.greedy]
    sampled = [row for row, s in enumerate(seqs) if not s.params.greedy]
    if greedy:
        tokens, tops = top_tokens(logits if len(greedy) == len(seqs) else logits[greedy], need_confidence)
        for row, token, top in zip(greedy, tokens, tops or [None] * len(greedy)):
            out[row] = (token, None, top)
    if sampled:
        probs = row_probs(logits if len(sampled) == len(seqs) else logits[sampled],
                          [seqs[row].params for row in sampled])
        tokens = draw(probs, [seqs[row].generator for row in sampled])
        tops = probs.amax(-1).tolist() if need_confidence else [None] * len(sampled)
        for i, (row, token, top) in enumerate(zip(sampled, tokens, tops)):
            out[row] = (token, probs[i], top)
    return out
