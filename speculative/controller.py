"""Whether the next step runs a round or decodes plainly.

A round lets every sequence draft its limit (``num_tokens``, less near its token limit); each
stops where its draft is unsure (the confidence threshold) or ends it. Where speculation pays that
is what fixed rounds do, and the threshold stops a sequence better than a length chosen ahead
from rates. What is chosen is whether a round pays at all, step by step.

The model. Plainly, ``B`` sequences yield ``B`` tokens in one pass costing ``T_plain(B)``. With the
batch's rates (``speculative.acceptance``: ``c_j`` the draft proposes its ``j``-th token, ``a_j``
the target accepts it) and ``speculative.lengths``' survival ``S_bj`` (sequence ``b`` runs ``j``
tokens past its next one; 0 past its limit ``g_b``), ``D_j = c_1 ... c_j``, ``A_j = a_1 ... a_j``:

    tokens              = sum_b (1 + sum_{j <= g_b} D_j A_j S_bj)
    draft pass j >= 1   rows_j = sum_b D_j S_b(j-1), run with probability 1 - prod_b (1 - D_j S_b(j-1))
    verification rows   = sum_b (1 + sum_{j <= g_b} D_j S_b(j-1))

each pass priced by ``speculative.costs`` (a drafted end keeps its pass and row, which a greedy round
leaves out: that overestimate measured better). A round is taken when its seconds per token, with a
draft model's catch-up spread over the tokens the batch is expected still to generate (at most
``num_tokens`` of each output), are at most ``1 / ROUND_MARGIN`` of plain decoding's.

Exploring: until ``EXPLORE`` verification passes are timed and ``EXPLORE`` sequence-rounds seen in
each sampling regime of the batch (``speculative.acceptance``: sampled rounds are priced on sampled
rounds), a step is a round as fixed rounds run it (so a fresh engine's first round is the one they
run where speculation pays); with the pass costs calibrated, only where a round whose every draft is
accepted would pay. Else plain, held ``HOLD_MAX`` steps however the batch shrinks and, unless a
token limit cut the round priced, over sequences joining it in its size class (one that has
generated nothing prices alike) until an output longer than every one recorded before is recorded
(one that has may pay). Nothing is priced before a plain pass is timed.

Catch-up: a draft model follows prompts at prefill only after a priced round (``drafting_lately``);
otherwise a round first fills in what it skipped in one pass. Holding: a priced decision is kept for
1 step, doubling each time pricing repeats it in the batch's size class (1, 2-3, 4-7, ...; a class
drained into goes on from the last span) up to ``HOLD_MAX`` (plain) or ``ROUND_HOLD_MAX`` (rounds).
A plain hold ends when a sequence joins or the batch shrinks into a smaller class; a round hold when
it grows into a larger one. Each constant is a default of ``Settings`` (docs/speculation.md).

Invariants: a chosen length is 0 or the limit; with ``fixed`` it is the limit. Decisions use past
rounds only, so verification stays exact.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from itertools import accumulate
from operator import mul
from typing import Callable, Hashable, Iterable

from speculative.acceptance import AcceptanceModel, DraftHistory
from speculative.costs import CONTEXT_SCALE, ROW_SCALE, PassCosts
from speculative.lengths import OutputLengths

EXPLORE = 2  # verification passes timed and sequence-rounds observed before pricing
ROUND_MARGIN = 1.05  # a round must promise this x plain decoding's goodput
HOLD_MAX = 64  # the most steps a priced plain decision is held
ROUND_HOLD_MAX = 16  # the most steps a priced round is held
HISTORIES_KEPT = 4096  # sequences whose mean draft length the stats summarise
CALIBRATE = 1  # 1: the engine times its passes before its first request


@dataclass(frozen=True, slots=True)
class Settings:
    """The controller's tunable constants, the module's by default (``python -m mmkv.bench
    spec-compare --set NAME=VALUE`` measures a change of them against the defaults), given to
    the engine in ``SpeculativeConfig.settings``."""

    explore: int = EXPLORE
    round_margin: float = ROUND_MARGIN
    hold_max: int = HOLD_MAX
    round_hold_max: int = ROUND_HOLD_MAX
    calibrate: int = CALIBRATE


class DraftLengthController:
    """Chooses draft lengths and learns from every pass it is told about.

    Guarantees: ``choose`` (and ``decide``) returns one length per sequence, 0 or its limit;
    with ``fixed=True`` every sequence drafts its limit (the costs and rates are still learned)."""

    def __init__(self, positions: int, fixed: bool = False,
                 clock: Callable[[], float] = time.perf_counter,
                 settings: Settings | None = None, costs: PassCosts | None = None) -> None:
        self.positions, self.fixed, self.clock = positions, fixed, clock
        self.settings = settings or Settings()
        self.costs = costs or PassCosts()  # the pass costs, learned here or kept from a calibration
        self.acceptance = AcceptanceModel(positions)
        self.lengths = OutputLengths()  # how long recent outputs ran (the engine records them)
        self.decisions = 0  # draft lengths chosen (one per sequence and step)
        self.zero = 0  # ... of which 0
        self.plain_steps = 0  # steps in which every sequence drafted 0
        self.rounds_priced = False  # whether the last priced decision was a round
        self.histories: deque[DraftHistory] = deque(maxlen=HISTORIES_KEPT)
        self.planned = 0  # decisions priced (the rest were held or explored)
        self._script: deque[int] = deque()  # ``follow_script``'s lengths still to draft
        self._hold: tuple[bool, int, int, bool, int | None] | None = None  # a round?, size class, steps
        # left, far?, and (None: not) kept over joins while no longer output than this is recorded
        self._spans: dict[tuple[bool, int], int] = {}  # (a round?, size class) -> its last hold's span
        self._last: tuple[bool, int] = (False, 0)  # the last priced decision: a round?, its span

    def follow_script(self, lengths: Iterable[int]) -> None:
        """Draft ``lengths`` in the next steps, one a step for every sequence (0: a plain step),
        instead of choosing: the engine's calibration times each kind of pass this way."""
        self._script.extend(lengths)

    @property
    def scripted(self) -> bool:
        """Whether steps of a script are still to come."""
        return bool(self._script)

    def new_history(self, regime: Hashable = "greedy") -> DraftHistory:
        """A sequence's history, its rounds pooled with those of its sampling ``regime``
        (``speculative.acceptance.regime``)."""
        history = DraftHistory(regime=regime)
        self.histories.append(history)
        return history

    def choose(self, histories: list[DraftHistory], limits: list[int], lengths: list[int],
               progress: list[tuple[int, int]] | None = None,
               behind: list[int] | None = None) -> list[int]:
        """Draft lengths for sequences of context ``lengths`` that may draft up to ``limits``;
        ``progress``: for each, the tokens it has generated and the most it may still generate
        (where it is expected to end comes from ``lengths``, what recent outputs ran to);
        ``behind``: for each, the positions a draft model must fill in before it can draft."""
        return self.decide(histories, lambda: limits, lambda: (lengths, progress, behind))

    def decide(self, histories: list[DraftHistory], limits: Callable[[], list[int]],
               state: Callable[[], tuple], beside_prompts: bool = False) -> list[int]:
        """``choose`` with its ``limits`` from ``limits()``, called for every step but a held
        plain one, and its ``lengths``, ``progress`` and ``behind`` from ``state()``, called only
        for a step that is priced or explores (a held step needs neither). A step ``beside_prompts``
        (it carries prompt chunks, whose pass its plain decoding joins) does not explore."""
        if self._script:
            length = self._script.popleft()
            caps = [min(length, limit) for limit in limits()]
        elif self.fixed:
            caps = list(limits())
        elif (held := self._held(histories)) is not None:
            caps = list(limits()) if held else [0] * len(histories)
        else:
            caps = self._caps(histories, limits(), *state(), beside_prompts)
        for history in histories:
            history.decisions += 1
        self.decisions += len(caps)
        self.zero += caps.count(0)
        self.plain_steps += not any(caps)
        return caps

    def _held(self, histories: list[DraftHistory]) -> bool | None:
        """The held decision (a round?) if this step keeps it (and counts it off), else None."""
        if self._hold is None:
            return None
        round_, size_class, left, far, over_joins = self._hold
        now, joined = len(histories).bit_length(), any(h.decisions == 0 for h in histories)
        kept = joined and over_joins is not None and now >= size_class and self.lengths.longest() <= over_joins
        if left == 0 or (now > size_class if round_ else joined and not kept or now < size_class and not far):
            return None
        self._hold = (round_, size_class, left - 1, far, over_joins)
        return round_

    def _hold_after(self, round_: bool, batch: int, far: bool = False, over_joins: int | None = None) -> None:
        """Hold a priced decision (a round, or plain decoding) for twice the span of the last one of
        its kind in this size class, or else of the last one priced (a draining batch keeps its span);
        ``far``: the longest span at once, kept as the batch shrinks and, with ``over_joins`` (the
        longest output recorded), as sequences join it in its size class until a longer output is
        recorded. The other kind's spans start again."""
        size_class, self.rounds_priced = batch.bit_length(), round_
        longest = self.settings.round_hold_max if round_ else self.settings.hold_max
        last = self._last[1] if self._last[0] == round_ else 0
        span = longest if far else min(longest, 2 * self._spans.get((round_, size_class), last)) or 1
        self._spans[(round_, size_class)], self._last = span, (round_, span)
        self._spans.pop((not round_, size_class), None)
        self._hold = (round_, size_class, span, far, over_joins)

    def drafting_lately(self) -> bool:
        """Whether the last priced decision was a round: while it was not, a draft model's K/V of
        new prompts is left to be filled in when a round needs it (a catch-up pass) instead of at
        prefill."""
        return self.fixed or self.rounds_priced

    def summary(self) -> dict[str, float]:
        """How often it drafted 0 and how often it priced its choice, and each sequence's mean
        draft length (drafts proposed per step it decided for), summarised over the last
        ``HISTORIES_KEPT`` sequences."""
        means = [h.drafted / h.decisions for h in self.histories if h.decisions] or [0.0]
        return {"spec_decisions": self.decisions, "spec_zero_drafts": self.zero,
                "spec_plain_steps": self.plain_steps, "spec_planned": self.planned,
                **{f"spec_seq_mean_draft_length_{name}": round(value, 4) for name, value in
                   (("min", min(means)), ("mean", sum(means) / len(means)), ("max", max(means)))}}

    def observe_round(self, history: DraftHistory, chosen: int, proposed: int, accepted: int,
                      confidence_stop: bool) -> None:
        self.acceptance.observe(history, chosen, proposed, accepted, confidence_stop)

    def observe_pass(self, kind: str, rows: int, context: int, seconds: float,
                     sequences: int | None = None) -> None:
        """A pass of ``kind`` over ``rows`` query tokens of ``sequences`` sequences (default:
        one row each) attending ``context`` tokens in all took ``seconds``."""
        self.costs.observe(kind, rows, context, seconds, sequences)

    def _caps(self, histories: list[DraftHistory], limits: list[int], lengths: list[int],
              progress: list[tuple[int, int]] | None, behind: list[int] | None,
              beside_prompts: bool = False) -> list[int]:
        batch = len(limits)
        if not any(limits):
            self._hold = None
            return [0] * batch
        explore, costs = self.settings.explore, self.costs
        if costs.count("verify") < explore or self.acceptance.rounds(histories) < explore:
            self._hold = None
            if beside_prompts:
                return [0] * batch
            if costs.count("plain") and costs.count("verify") and not self._pays(
                    histories, limits, lengths, progress, behind, sure=True):
                self.planned += 1  # not even a draft that is always right would pay; one joining is
                full = min(limits) == self.positions  # priced alike, unless a token limit cut these
                self._hold_after(False, batch, far=True, over_joins=self.lengths.longest() if full else None)
                return [0] * batch
            return list(limits)
        if not costs.count("plain"):
            self._hold = None
            return [0] * batch  # no pricing before a plain pass is timed
        self.planned += 1
        pays = self._pays(histories, limits, lengths, progress, behind)
        self._hold_after(pays, batch)
        return list(limits) if pays else [0] * batch

    def _pays(self, histories: list[DraftHistory], limits: list[int], lengths: list[int],
              progress: list[tuple[int, int]] | None, behind: list[int] | None, sure: bool = False) -> bool:
        """Whether a round beats plain decoding by the margin, its catch-up included, priced with
        the batch's rates (its sequences' ``histories``) or, ``sure``, with every draft accepted;
        alike sequences once, in scalar loops (numpy's per-call cost outweighs a few dozen terms)."""
        costs, batch, depth = self.costs, len(limits), max(limits)
        proposed, accepted = ([1.0] * depth,) * 2 if sure else self.acceptance.batch_rates(histories, depth)
        d, a = list(accumulate(proposed, mul)), list(accumulate(map(mul, proposed, accepted), mul))
        horizon = max(depth, self.positions)  # a catch-up's spread: num_tokens of each output at most
        survival = (self.lengths.survival([g for g, _ in progress], horizon) if progress is not None
                    else {None: [1.0] * (horizon + 1)})  # nothing known of where they end: no end
        alike: dict[tuple, list[float]] = {}  # (generated, cap, limit) -> [sequences, their context]
        for (generated, cap), limit, size in zip(progress or [(None, n + 1) for n in limits], limits, lengths):
            group = alike.setdefault((generated, cap, limit), [0, 0.0])
            group[0], group[1] = group[0] + 1, group[1] + size
        rows, idle = [0.0] * depth, [1.0] * depth  # a draft pass's rows; the chance it runs for nobody
        tokens, attended, running = float(batch), 0.0, 0.0
        for (generated, cap, limit), (count, sizes) in alike.items():  # no token past the limit:
            chance = survival[generated][:cap] + [0.0] * (horizon + 1 - cap)
            running += count * sum(chance)
            for j in range(limit):  # the j+1-th draft: proposed, and the token after it accepted
                propose = d[j] * chance[j]
                rows[j] += count * propose
                idle[j] *= (1.0 - propose) ** count
                attended += (sizes + count * (j + 1)) * propose
                tokens += count * a[j] * chance[j + 1]
        runs, rows, context = sum(1.0 - x for x in idle), sum(rows), float(sum(lengths))
        _, d_rows, d_seqs, d_context, _ = costs.fit("draft").theta
        _, v_rows, v_seqs, v_context, _ = costs.fit("verify").theta
        seconds = (costs.predict("first_draft", batch, context) + costs.fixed("draft") * runs
                   + (d_rows + d_seqs) / ROW_SCALE * rows + d_context / CONTEXT_SCALE * attended
                   + max(costs.intercept("verify") + v_rows / ROW_SCALE * (batch + rows)
                         + v_seqs / ROW_SCALE * batch + v_context / CONTEXT_SCALE * (context + attended), 1e-7))
        if behind is not None and any(behind):  # the catch-up, spread over the outputs still to come
            debt = float(sum(behind))
            seconds += tokens / running * costs.predict("catch_up", debt, sum(
                b * (size - b / 2) for b, size in zip(behind, lengths)), float(sum(map(bool, behind))))
        return self.settings.round_margin * seconds / tokens <= costs.predict("plain", batch, context) / batch
