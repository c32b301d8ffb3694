"""Whether the next step runs a round or decodes plainly.

A round lets every sequence draft its limit (``num_tokens``, less near its token limit), each
stopping where its draft is unsure or ends it: what fixed rounds run. Each step it is chosen
whether a round pays: its expected tokens (acceptance by position in the batch's sampling regimes,
``speculative.acceptance``; how far each sequence will run, ``speculative.lengths``) against its
seconds (``speculative.costs``, each kind of step at what such steps have taken, a draft model's
catch-up spread over the tokens still to come), at least ``ROUND_MARGIN`` x plain decoding's
tokens a second; beside prompt chunks plain decoding costs its share of their pass. A fresh
controller times a plain step, then explores (fixed rounds where a round of sure drafts would
pay, a draft model's first with the 1 in ``FIRST_SHARE`` of the batch it has least to catch up)
until ``EXPLORE`` verifications and sequence-rounds of each regime are seen. A priced decision
is held 1 step, doubling while pricing repeats it, up to ``HOLD_MAX`` (plain) or ``ROUND_HOLD_MAX``
(rounds) steps, until a sequence joins or the batch's size class changes; after ``HOLD_MAX`` plain
steps a round probes acceptance. The model in full: docs/speculation.md.

Invariants: a chosen length is 0 or the limit; with ``fixed`` it is the limit. Decisions use past
rounds only, so verification stays exact. Each constant is a default of ``Settings``.
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
ROUND_MARGIN = 1.15  # a round must promise this x plain decoding's goodput
HOLD_MAX = 64  # the most steps a priced plain decision is held
ROUND_HOLD_MAX = 16  # the most steps a priced round is held
HISTORIES_KEPT = 4096  # sequences whose mean draft length the stats summarise
FIRST_SHARE = 4  # a draft model's first round catches up 1 in this many sequences (the least behind)
CALIBRATE = 0  # 1: the engine times its passes before its first request (0: it learns in its first steps)


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
    first_share: int = FIRST_SHARE


class DraftLengthController:
    """Chooses draft lengths and learns from every pass it is told about.

    Guarantees: ``choose`` (and ``decide``) returns one length per sequence, 0 or its limit;
    with ``fixed=True`` every sequence drafts its limit (the costs and rates are still learned)."""

    def __init__(self, positions: int, fixed: bool = False, clock: Callable[[], float] = time.perf_counter,
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
        self._hold: tuple[bool, int, int] | None = None  # a round?, size class, steps left
        self._span: tuple[bool, int] = (False, 0)  # the last priced decision (a round?) and its span
        self._plain_run = 0  # steps since the last round
        self._held_plain = False  # whether this step keeps a held plain decision (its pass teaches nothing)

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
        ``progress``: each one's tokens generated and the most it may still generate; ``behind``:
        the positions a draft model must fill in before each can draft."""
        return self.decide(histories, lambda: limits, lambda: (lengths, progress, behind))

    def decide(self, histories: list[DraftHistory], limits: Callable[[], list[int]],
               state: Callable[[], tuple], beside_prompts: bool = False) -> list[int]:
        """``choose`` with ``limits()`` read for every step but a held plain one and ``state()``
        (``lengths``, ``progress``, ``behind``) only for a step priced or exploring. A step
        ``beside_prompts`` (carrying prompt chunks) is always priced and neither explores nor holds."""
        held = None if self._script or self.fixed or beside_prompts else self._held(histories)
        if self._script:
            length = self._script.popleft()
            caps = [min(length, limit) for limit in limits()]
        elif self.fixed:
            caps = list(limits())
        elif held is not None:
            caps = list(limits()) if held else [0] * len(histories)
        else:
            caps = self._caps(histories, limits(), *state(), beside_prompts)
        for history in histories:
            history.decisions += 1
        self.decisions += len(caps)
        self.zero += caps.count(0)
        self.plain_steps += not any(caps)
        self._held_plain = held is False
        self._plain_run = 0 if any(caps) else self._plain_run + 1
        return caps

    def _held(self, histories: list[DraftHistory]) -> bool | None:
        """The held decision (a round?) if this step keeps it (counting it off), else None; a
        batch a sequence joined, or of another size class, is priced afresh, spans from 1."""
        if self._hold is None:
            return None
        round_, size_class, left = self._hold
        if len(histories).bit_length() != size_class or any(h.decisions == 0 for h in histories):
            self._hold, self._span = None, (False, 0)
            return None
        self._hold = (round_, size_class, left - 1) if left else None
        return round_ if left else None

    def _priced(self, round_: bool, limits: list[int], beside_prompts: bool) -> list[int]:
        """A priced decision's lengths. Beside no prompts it is held for twice the span of the
        last one if pricing repeats it, else for 1 step (a step beside prompts holds nothing)."""
        self.planned += 1
        self.rounds_priced = round_
        if not beside_prompts:
            last_round, last = self._span
            longest = self.settings.round_hold_max if round_ else self.settings.hold_max
            span = min(longest, 2 * last) if last_round == round_ and last else 1
            self._span, self._hold = (round_, span), (round_, len(limits).bit_length(), span)
        return list(limits) if round_ else [0] * len(limits)

    def drafting_lately(self) -> bool:
        """Whether the last priced decision was a round (else a draft model skips new prompts at
        prefill, to be caught up when a round needs them)."""
        return self.fixed or self.rounds_priced

    def summary(self) -> dict[str, float]:
        """Decisions, of them 0 and priced, and recent sequences' mean draft lengths (drafts a step)."""
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
        one row each) attending ``context`` tokens in all took ``seconds`` (unless a held plain pass)."""
        if kind != "plain" or not self._held_plain:
            self.costs.observe(kind, rows, context, seconds, sequences)

    def _caps(self, histories: list[DraftHistory], limits: list[int], lengths: list[int],
              progress: list[tuple[int, int]] | None, behind: list[int] | None,
              beside_prompts: bool = False) -> list[int]:
        costs, explore, batch = self.costs, self.settings.explore, len(limits)
        state = (histories, limits, lengths, progress, behind, beside_prompts)
        if not any(limits) or not costs.counts["plain"]:  # a plain pass is timed first: pricing needs it
            return [0] * batch
        if costs.counts["verify"] < explore or self.acceptance.rounds(histories) < explore:
            if costs.counts["verify"] and not self._pays(*state, sure=True):  # not even a sure draft pays
                return self._priced(False, limits, beside_prompts)
            if beside_prompts:
                return [0] * batch
            if costs.counts["verify"] or not behind:
                return list(limits)
            share = max(-(-batch // self.settings.first_share), behind.count(0))  # the least behind
            first = set(sorted(range(batch), key=behind.__getitem__)[:share])
            return [limit if i in first else 0 for i, limit in enumerate(limits)]
        if self._plain_run >= self.settings.hold_max and not beside_prompts and self._pays(*state, sure=True):
            return list(limits)  # a probe: plain decoding has learned nothing of acceptance
        return self._priced(self._pays(*state), limits, beside_prompts)

    def _pays(self, histories: list[DraftHistory], limits: list[int], lengths: list[int],
              progress: list[tuple[int, int]] | None, behind: list[int] | None,
              beside_prompts: bool = False, sure: bool = False) -> bool:
        """Whether a round beats plain decoding by the margin, its catch-up included, at the
        batch's rates or, ``sure``, every draft accepted; beside prompt chunks plain decoding costs
        its share of their pass but not its fixed part. Alike sequences are priced once, in scalar
        loops (numpy's per-call cost outweighs a few dozen terms)."""
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
        v_fixed, v_rows, v_seqs, v_context, v_extra = costs.fit("verify").theta
        seconds = (costs.predict("first_draft", batch, context) + costs.fixed("draft") * runs
                   + (d_rows + d_seqs) / ROW_SCALE * rows + d_context / CONTEXT_SCALE * attended
                   + max(v_fixed + v_extra + v_rows / ROW_SCALE * (batch + rows)
                         + v_seqs / ROW_SCALE * batch + v_context / CONTEXT_SCALE * (context + attended), 1e-7))
        if behind is not None and any(behind):  # the catch-up, spread over the outputs still to come
            debt = float(sum(behind))
            seconds += tokens / running * costs.predict("catch_up", debt, sum(
                b * (size - b / 2) for b, size in zip(behind, lengths)), float(sum(map(bool, behind))))
        plain = max(costs.predict("plain", batch, context) - beside_prompts * costs.fixed("plain"), 1e-7)
        seconds, plain = seconds * costs.step_factor(True, batch), plain * costs.step_factor(False, batch)
        return self.settings.round_margin * seconds / tokens <= plain / batch
