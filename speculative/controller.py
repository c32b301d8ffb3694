"""Each sequence's draft length for the next round, 0 included, from measured costs and acceptance.

The model. Plainly, ``B`` sequences yield ``B`` tokens in one pass costing ``T_plain(B)``. A round
in which sequence ``b`` may draft up to ``g_b`` tokens runs draft passes ``i = 0, 1, ...`` and one
verification pass. With its smoothed rates (``speculative.acceptance``: ``c_j`` it proposes the
``j``-th draft, ``a_j`` the target accepts it) and ``speculative.lengths``' survival:

    D_bj = c_b1 ... c_bj      (it proposes a j-th draft)
    A_bj = a_b1 ... a_bj      (the first j proposals are all accepted, given proposed)
    S_bj                      (its output runs j tokens past its next one; 0 past its limit)
    tokens      = sum_b (1 + sum_{j <= g_b} D_bj A_bj S_bj)
    draft pass i, i >= 1:   rows_i = sum_{b: g_b >= i} D_bi S_b(i-1), run with probability
                            1 - prod (1 - D_bi S_b(i-1))
    verification rows       = sum_b (1 + sum_{j <= g_b} D_bj S_b(j-1))

each pass priced by ``speculative.costs``. Goodput is expected tokens per expected second; plain
decoding's is ``B / T_plain(B)``. No draft is proposed past an end-of-sequence token.

The choice. At goodput ``R`` a ``j``-th draft pays while ``A_bj S_bj >= R (m_draft + m_verify)``
(its row's seconds in draft pass ``j`` and in verification): sequence ``b``'s horizon ``h_b``.
Every length ``L`` up to the longest horizon (caps ``min(L, h_b)``) is priced with the passes'
fixed costs; ``R`` starts at plain decoding's goodput and is raised once to the best round's
(Dinkelbach). The best round is taken if it promises ``ROUND_MARGIN`` x plain decoding's goodput
(``STAY_MARGIN`` x while at least ``STAYING`` of recent steps ran rounds and the batch's size
class, 1, 2-3, 4-7, ..., is no larger than the last drafting step's); otherwise every sequence
drafts 0. Once rounds are observed, a priced round drafts for at most ``WIDTH_GROWTH`` x the
sequence-rounds the rates rest on, those with the most net tokens.

Exploring. Until ``EXPLORE`` verification passes are timed and ``EXPLORE`` sequence-rounds
observed, the first ``explore_sequences`` sequences (default: all) draft up to ``explore_length``
(``EXPLORE_LENGTH``; early exit ``EARLY_EXIT_EXPLORE_LENGTH``). With plain and verification costs
known (``CALIBRATE``: the engine times scripted steps before its first request, and the controller
keeps only those fits) such a step is first priced with every draft accepted and decodes plainly if
even that does not pay. Nothing is priced before a plain pass is timed: verification passes alone
cannot tell their extra fixed cost from plain decoding's.

Catch-up. A round in which a draft model must fill in skipped positions pays a catch-up pass's
fixed cost, and each sequence's catch-up rows are charged whole to it: such a sequence drafts only
where its expected tokens, net of their rows' cost at ``R``, cover them, and at most
``FRONTIER_GROWTH`` x as deep as any round has reached. ``drafting_lately`` (``rounds_share`` at
least ``PREFILL_DRAFT_SHARE``) tells a draft model whether to follow prompts at prefill.

Holding. A priced plain decision is kept unplanned while no sequence joins and the batch stays in
its size class or a larger one: 1 step, doubling per repeat in that class up to ``HOLD_MAX``, or
``HOLD_MAX`` at once when the best it priced fell short of the margin by more than ``HOLD_GAP`` of
it. A priced round's lengths (clipped to the limits) are kept while no sequence joins: 1 round,
doubling while pricing picks the same sequences, up to ``ROUND_HOLD_MAX``, and only while the rates
rest on ``ROUND_HOLD_EVIDENCE`` x the observations a round adds.

Each constant here is a default of ``Settings`` (``python -m mmkv.bench spec-compare --set
NAME=VALUE`` measures a change). Why each rule and what it measured: docs/speculation.md.

Invariants: a chosen length is in ``[0, limit]``; with ``fixed`` it is the limit. Lengths come from
past rounds only, never from a round's own outcomes, so verification stays exact.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, fields
from typing import Callable, Iterable

import numpy as np

from speculative.acceptance import AcceptanceModel, DraftHistory
from speculative.costs import CONTEXT_SCALE, ROW_SCALE, PassCosts
from speculative.lengths import OutputLengths

EXPLORE = 2  # verification passes timed and sequence-rounds observed before pricing
EXPLORE_LENGTH = 2  # the most an exploring round drafts, unless the speculator asks for more
EARLY_EXIT_EXPLORE_LENGTH = 4  # ... for early exit
FRONTIER_GROWTH = 3  # a sequence caught up drafts at most this x as deep as any round has reached
WIDTH_GROWTH = 3  # a round drafts for at most this x the sequence-rounds the rates rest on
ROUND_MARGIN = 1.1  # a round must promise this x plain decoding's goodput
STAY_MARGIN = 1.0  # ... while STAYING of recent steps ran rounds and the size class has not grown
STAYING = 0.5  # the share of recent steps that ran rounds from which the stay margin applies
HOLD_MAX = 64  # the most steps a priced plain decision is held
HOLD_GAP = 0.2  # ... at once, if the best it priced fell short of the margin by more than this share
ROUND_HOLD_MAX = 16  # the most rounds a priced round's lengths are held
ROUND_HOLD_EVIDENCE = 1.0  # ... only if the rates rest on this x the observations the round adds
HISTORIES_KEPT = 4096  # sequences whose mean draft length the stats summarise
ROUNDS_SMOOTHING = 0.1  # weight of the latest step in ``rounds_share``
PREFILL_DRAFT_SHARE = 0.2  # the draft model follows prompts while rounds_share is at least this
CALIBRATE = 1  # 1: the engine times its passes before its first request


@dataclass(frozen=True, slots=True)
class Settings:
    """The controller's tunable constants, the module's by default (``python -m mmkv.bench
    spec-compare --set NAME=VALUE`` measures a change of them against the defaults), given to
    the engine in ``SpeculativeConfig.settings``."""

    explore: int = EXPLORE
    frontier_growth: int = FRONTIER_GROWTH
    round_margin: float = ROUND_MARGIN
    stay_margin: float = STAY_MARGIN
    hold_max: int = HOLD_MAX
    hold_gap: float = HOLD_GAP
    round_hold_max: int = ROUND_HOLD_MAX
    round_hold_evidence: float = ROUND_HOLD_EVIDENCE
    prefill_draft_share: float = PREFILL_DRAFT_SHARE
    calibrate: int = CALIBRATE
    width_growth: int = WIDTH_GROWTH

    @classmethod
    def parse(cls, assignments: list[str]) -> Settings:
        """Settings from ``NAME=VALUE`` strings (the others the defaults); a name that is not a
        setting, or a value of the wrong type, raises ``ValueError`` naming it."""
        kinds = {"int": (int, "an integer"), "float": (float, "a number")}
        types = {f.name: kinds[f.type] for f in fields(cls)}
        values = {}
        for assignment in assignments:
            name, sep, value = assignment.partition("=")
            if not sep or name not in types:
                raise ValueError(f"{assignment!r}: expected NAME=VALUE with NAME one of {sorted(types)}")
            convert, kind = types[name]
            try:
                values[name] = convert(value)
            except ValueError:
                raise ValueError(f"{assignment!r}: {name} takes {kind}") from None
        return cls(**values)


class DraftLengthController:
    """Chooses draft lengths and learns from every pass it is told about.

    Guarantees: ``choose`` (and ``decide``) returns one length per sequence within its limit;
    with ``fixed=True`` every sequence drafts its limit (the costs and rates are still learned)."""

    def __init__(self, positions: int, fixed: bool = False,
                 clock: Callable[[], float] = time.perf_counter,
                 explore_sequences: int | None = None, explore_length: int = EXPLORE_LENGTH,
                 settings: Settings | None = None, costs: PassCosts | None = None) -> None:
        self.positions, self.fixed, self.clock = positions, fixed, clock
        self.settings = settings or Settings()
        self.explore_sequences = explore_sequences  # None: every sequence explores
        self.explore_length = explore_length
        self.costs = costs or PassCosts()  # the pass costs, learned here or kept from a calibration
        self.acceptance = AcceptanceModel(positions)
        self.lengths = OutputLengths()  # how long recent outputs ran (the engine records them)
        self.decisions = 0  # draft lengths chosen (one per sequence and step)
        self.zero = 0  # ... of which 0
        self.plain_steps = 0  # steps in which every candidate drafted 0
        self.rounds_share = 0.0  # smoothed share of recent steps that ran a round
        self.histories: deque[DraftHistory] = deque(maxlen=HISTORIES_KEPT)
        self.planned = 0  # choices priced (the rest were held or explored)
        self._script: deque[int] = deque()  # ``follow_script``'s lengths still to draft
        self._hold: tuple[int, int] | None = None  # the held plain decision: batch size class, steps left
        self._plain_spans: dict[int, int] = {}  # batch size class -> its last plain hold's span
        self._far = False  # the last priced plain decision was far from paying (Holding)
        self._rounds_class = 0  # the batch size class of the last step that ran a round
        self._round_hold: tuple[dict[int, tuple[DraftHistory, int]], int, int] | None = None
        # each sequence's length by id(history) (the history kept, so the id stays its own),
        # rounds left, the span

    def follow_script(self, lengths: Iterable[int]) -> None:
        """Draft ``lengths`` in the next steps, one a step for every sequence (0: a plain step),
        instead of choosing: the engine's calibration times each kind of pass this way."""
        self._script.extend(lengths)

    @property
    def scripted(self) -> bool:
        """Whether steps of a script are still to come."""
        return bool(self._script)

    def new_history(self) -> DraftHistory:
        history = self.acceptance.new_history()
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
               state: Callable[[], tuple[list[int], list[tuple[int, int]] | None, list[int] | None]]
               ) -> list[int]:
        """``choose`` with its ``limits`` from ``limits()``, called for every step but one that
        keeps a held plain decision, and its ``lengths``, ``progress`` and ``behind`` from
        ``state()``, called only for a step that is priced or explores (a step that keeps a held
        decision needs neither, so it does not build them)."""
        if self._script:
            length = self._script.popleft()
            caps = [min(length, limit) for limit in limits()]
        elif self.fixed:
            caps = list(limits())
        elif self._holding(histories):
            caps = [0] * len(histories)
        elif (held := self._held_round(histories, limits)) is not None:
            caps = held
        else:
            planned, self._far = self.planned, False
            caps = self._caps(histories, limits(), *state())
            self._hold_after(caps, histories, priced=self.planned > planned)
        for history, cap in zip(histories, caps):
            history.decisions += 1
        self.decisions += len(caps)
        self.zero += caps.count(0)
        drafting = any(caps)
        self.plain_steps += not drafting
        self.rounds_share += ROUNDS_SMOOTHING * (drafting - self.rounds_share)
        if drafting:
            self._rounds_class = len(caps).bit_length()
        return caps

    def _holding(self, histories: list[DraftHistory]) -> bool:
        """Whether this step keeps a held plain decision (and counts it off)."""
        hold = self._hold
        if (hold is None or len(histories).bit_length() < hold[0] or hold[1] == 0
                or any(h.decisions == 0 for h in histories)):  # a sequence joined
            return False
        self._hold = (hold[0], hold[1] - 1)
        return True

    def _held_round(self, histories: list[DraftHistory],
                    limits: Callable[[], list[int]]) -> list[int] | None:
        """The held round's lengths within ``limits()`` if this step holds it (and counts it off)."""
        hold = self._round_hold
        if hold is None or hold[1] == 0:
            return None
        caps = []
        for history in histories:
            if (entry := hold[0].get(id(history))) is None:
                return None  # a sequence joined
            caps.append(entry[1])
        if not any(caps):
            return None  # every sequence it drafted for has ended
        self._round_hold = (hold[0], hold[1] - 1, hold[2])
        return [min(cap, limit) for cap, limit in zip(caps, limits())]

    def _hold_after(self, caps: list[int], histories: list[DraftHistory], priced: bool) -> None:
        """Start a hold after a priced decision, twice as long as the last one of its kind (a
        round's with the same sequences drafting, or a plain step's in this batch size class); a
        priced round starts its class's plain span again."""
        size_class = len(caps).bit_length()
        if not priced:
            self._hold = None
        elif any(caps):
            last = self._round_hold
            same = last is not None and all((last[0].get(id(h), (h, 0))[1] > 0) == (c > 0)
                                            for h, c in zip(histories, caps))
            span = min(self.settings.round_hold_max, 2 * last[2]) if same else 1
            drafting = sum(c > 0 for c in caps)
            evidence = self.acceptance.proposed.trials[0]
            held = span if evidence >= self.settings.round_hold_evidence * drafting else 0
            self._hold = None
            self._round_hold = ({id(h): (h, c) for h, c in zip(histories, caps)}, held, span)
            self._plain_spans.pop(size_class, None)
        else:
            span = (self.settings.hold_max if self._far
                    else min(self.settings.hold_max, 2 * self._plain_spans.get(size_class, 0)) or 1)
            self._plain_spans[size_class] = span
            self._hold, self._round_hold = (size_class, span), None

    def drafting_lately(self) -> bool:
        """Whether recent steps ran rounds: while they do not, a draft model's K/V of new prompts
        is left to be filled in when a round needs it (a catch-up pass) instead of at prefill."""
        return self.fixed or self.rounds_share >= self.settings.prefill_draft_share

    def summary(self) -> dict[str, float]:
        """How often it drafted 0 and how often it priced its choice, and each sequence's mean
        draft length (drafts proposed per step it decided for), summarised over the last
        ``HISTORIES_KEPT`` sequences."""
        means = [h.drafted / h.decisions for h in self.histories if h.decisions]
        return {"spec_decisions": self.decisions, "spec_zero_drafts": self.zero,
                "spec_plain_steps": self.plain_steps, "spec_planned": self.planned,
                "spec_seq_mean_draft_length_min": round(min(means), 4) if means else 0.0,
                "spec_seq_mean_draft_length_mean": round(sum(means) / len(means), 4) if means else 0.0,
                "spec_seq_mean_draft_length_max": round(max(means), 4) if means else 0.0}

    def observe_round(self, history: DraftHistory, chosen: int, proposed: int, accepted: int,
                      confidence_stop: bool) -> None:
        self.acceptance.observe(history, chosen, proposed, accepted, confidence_stop)

    def observe_pass(self, kind: str, rows: int, context: int, seconds: float,
                     sequences: int | None = None) -> None:
        """A pass of ``kind`` over ``rows`` query tokens of ``sequences`` sequences (default:
        one row each) attending ``context`` tokens in all took ``seconds``."""
        self.costs.observe(kind, rows, context, seconds, sequences)

    def _caps(self, histories: list[DraftHistory], limits: list[int], lengths: list[int],
              progress: list[tuple[int, int]] | None = None,
              behind: list[int] | None = None) -> list[int]:
        if not any(limits):
            return [0] * len(limits)
        explore = self.settings.explore
        if self.costs.count("verify") < explore or self.acceptance.version < explore:
            if (self.costs.count("plain") and self.costs.count("verify")
                    and not any(self._priced(histories, limits, lengths, progress, behind, sure=True))):
                self.planned += 1  # a priced plain decision, held as one (an exploring round is not)
                self._far = True  # not even a draft that is always right would pay
                return [0] * len(limits)
            caps, room = [], self.explore_sequences or len(limits)
            for limit in limits:
                caps.append(min(limit, self.explore_length) if room else 0)
                room -= caps[-1] > 0
            return caps
        if not self.costs.count("plain"):
            return [0] * len(limits)  # no pricing before a plain pass is timed
        self.planned += 1
        return self._priced(histories, limits, lengths, progress, behind)

    def _priced(self, histories: list[DraftHistory], limits: list[int], lengths: list[int],
                progress: list[tuple[int, int]] | None, behind: list[int] | None,
                sure: bool = False) -> list[int]:
        """The lengths of the best round if it beats plain decoding by the margin, else 0s
        (``sure``: priced as if every draft were proposed and accepted)."""
        if behind is not None and any(behind):
            frontier = self.settings.frontier_growth * max(self.explore_length, self.acceptance.reached)
            limits = [min(limit, frontier) if debt else limit for limit, debt in zip(limits, behind)]
        costs, batch, context = self.costs, len(limits), sum(lengths)
        plain = batch / costs.predict("plain", batch, context)
        proposes, accepted, accepts = self._curves(histories, limits, sure)
        if progress is not None and self.lengths.recent:  # no draft or token past the output's end
            running = self.lengths.survival([generated for generated, _ in progress], proposes.shape[1])
            running[np.arange(running.shape[1]) >= np.asarray([cap for _, cap in progress])[:, None]] = 0.0
            proposes, accepts = proposes * running[:, :-1], accepts * running[:, 1:]
            accepted = accepted * running[:, 1:]
        sizes = np.asarray(lengths, dtype=np.float64)
        # a j-th draft: one more sequence in draft pass j, one more row of a verified sequence
        per_row = _variable(costs, "draft", 1.0, sizes, 1.0) + _variable(costs, "verify", 1.0, sizes, 0.0)
        staying = self.rounds_share >= STAYING and batch.bit_length() <= self._rounds_class
        margin = self.settings.stay_margin if staying else self.settings.round_margin
        far = (1.0 - self.settings.hold_gap) * margin  # promising less than this x plain: far
        if not (accepted[:, 0] >= plain * per_row).any():  # no first draft pays at plain's goodput
            self._far = not (accepted[:, 0] >= far * plain * per_row).any()
            return [0] * batch
        debts = np.asarray(behind, dtype=np.float64) if behind is not None and any(behind) else None
        if debts is not None:  # seconds of each sequence's catch-up rows
            catch_up = _variable(costs, "catch_up", debts, debts * (sizes - debts / 2), debts > 0)
        best, caps, goal, previous = margin * plain, [0] * batch, plain, None
        seen = self.acceptance.proposed.trials[0]  # the sequence-rounds the rates rest on
        width = max(1, int(self.settings.width_growth * seen)) if seen and not sure else batch
        for _ in range(2):
            horizons = (accepted >= goal * per_row[:, None]).sum(axis=1)
            if debts is not None or (horizons > 0).sum() > width:
                within = np.arange(proposes.shape[1]) < horizons[:, None]
                net = ((accepts - goal * per_row[:, None] * proposes) * within).sum(axis=1)
                if debts is not None:  # drafting must also earn its whole catch-up, in this round
                    net -= goal * catch_up
                    horizons[net < 0] = 0
                if (horizons > 0).sum() > width:  # those with the most net tokens draft
                    horizons[np.argsort(-net, kind="stable")[width:]] = 0
            if previous is not None and np.array_equal(horizons, previous):
                break  # the round just priced: no better
            drafting, previous = horizons > 0, horizons
            owed = debts is not None and bool(debts[drafting].any())
            rate, length = self._best_round(proposes, accepts, horizons, sizes,
                                            float(catch_up[drafting].sum()) if owed else 0.0, owed)
            if rate <= best:
                self._far = goal == plain and rate < far * plain
                break
            best, goal = rate, rate
            caps = np.minimum(length, horizons).tolist()
        return caps

    def _curves(self, histories: list[DraftHistory], limits: list[int],
                sure: bool = False) -> tuple[np.ndarray, ...]:
        """Every sequence's cumulative products of its rates as rows of ``[B, max limit]``
        arrays: it proposes a ``j``-th draft; its first ``j`` proposals are all accepted; both
        (``sure``: every rate 1). Past a sequence's limit the rows hold 0, 0 and -1 (below any
        threshold)."""
        if sure:
            proposed = accepted = np.ones((len(histories), max(limits)))
        else:
            proposed, accepted = self.acceptance.rates(histories, max(limits))
        d, a = np.cumprod(proposed, axis=1), np.cumprod(accepted, axis=1)
        past = np.arange(d.shape[1]) >= np.asarray(limits)[:, None]
        d[past] = 0.0
        both = d * a
        a[past] = -1.0
        return d, a, both

    def _best_round(self, proposes: np.ndarray, accepts: np.ndarray, horizons: np.ndarray,
                    lengths: np.ndarray, catch_up: float = 0.0,
                    catches_up: bool = False) -> tuple[float, int]:
        """The best goodput of a round of length ``L`` (caps ``min(L, h_b)``) and that ``L``
        (the shortest of equals), every ``L`` priced at once: column ``i - 1`` is draft pass ``i``.
        ``catch_up``: seconds of the drafting sequences' catch-up rows charged to this round
        (``catches_up``: a catch-up pass runs, at its fixed cost)."""
        longest = int(horizons.max(initial=0))
        if longest == 0:
            return 0.0, 0
        costs, batch, context = self.costs, len(lengths), float(lengths.sum())
        position = np.arange(1, longest + 1)
        carried = horizons[:, None] >= position  # [B, L]: sequence b may draft at pass i
        d = proposes[:, :longest] * carried
        rows = d.sum(axis=0)
        runs = 1.0 - np.prod(1.0 - d, axis=0)  # the pass runs if anyone proposes in it
        # rows, attended context and passes run up to each pass, and the tokens they yield
        rows_to, attended_to = np.cumsum(rows), np.cumsum(lengths @ d + position * rows)
        tokens = batch + np.cumsum((accepts[:, :longest] * carried).sum(axis=0))
        _, d_rows, d_seqs, d_context, _ = costs.fit("draft").theta  # a later draft pass: one row each
        seconds = (costs.predict("first_draft", batch, context) + catch_up
                   + catches_up * costs.fixed("catch_up") + costs.fixed("draft") * np.cumsum(runs)
                   + ((d_rows + d_seqs) / ROW_SCALE) * rows_to + (d_context / CONTEXT_SCALE) * attended_to)
        _, v_rows, v_seqs, v_context, _ = costs.fit("verify").theta
        verify = np.maximum(costs.intercept("verify") + (v_rows / ROW_SCALE) * (batch + rows_to)
                            + (v_seqs / ROW_SCALE) * batch + (v_context / CONTEXT_SCALE) * (context + attended_to),
                            1e-7)
        rate = tokens / (seconds + verify)
        best = int(np.argmax(rate))
        return (float(rate[best]), best + 1) if rate[best] > 0 else (0.0, 0)


def _variable(costs: PassCosts, kind: str, rows, context, sequences) -> np.ndarray:
    """The part of a pass's predicted seconds that grows with its rows, sequences and context,
    over arrays."""
    _, t_rows, t_seqs, t_context, _ = costs.fit(kind).theta
    return ((t_rows / ROW_SCALE) * rows + (t_seqs / ROW_SCALE) * sequences
            + (t_context / CONTEXT_SCALE) * context)

