"""Each sequence's draft length for the next round, 0 included, from measured costs and acceptance.

The model. A step decodes ``B`` sequences (context lengths ``n_b``). Decoding them plainly yields
``B`` tokens in one pass costing ``T_plain(B)``. A speculative round in which sequence ``b`` may
draft up to ``g_b`` tokens runs draft passes ``i = 0, 1, ...`` (pass 0 reads every pending token;
pass ``i`` carries every sequence that proposed its ``i``-th draft) and one verification pass over
each sequence's pending token and proposals. With the sequence's smoothed per-position rates
(``speculative.acceptance``: ``c_j`` it proposes the ``j``-th draft, ``a_j`` the target accepts it)

    D_bj = c_b1 ... c_bj      (it proposes a j-th draft)
    A_bj = a_b1 ... a_bj      (the first j proposals are all accepted, given proposed)
    S_bj                      (its output runs at least j tokens past its next one: the share of
                               recent outputs that ran that far, ``speculative.lengths``; 0
                               past its token limit)
    tokens      = sum_b (1 + sum_{j <= g_b} D_bj A_bj S_bj)
    draft pass i, i >= 1:   rows_i = sum_{b: g_b >= i} D_bi S_b(i-1), run with probability
                            1 - prod (1 - D_bi S_b(i-1))
    verification rows       = sum_b (1 + sum_{j <= g_b} D_bj S_b(j-1))

and the cost of each pass from ``speculative.costs`` (a fixed part and parts per row, per
sequence and per context token, fitted online: plain decoding and verification share one fit,
the first and later draft passes another, verification and the first draft pass paying an extra
fixed part; a draft model's catch-up passes have their own). The round's goodput is expected
tokens per expected second; plain decoding's is ``B / T_plain(B)``.

(No draft is proposed past an end-of-sequence token, and no token follows one: a summary two
tokens from its end gets two tokens from a round of eight drafts.)

The choice. A ``j``-th draft of sequence ``b`` adds ``D_bj A_bj S_bj`` expected tokens for at most
``D_bj (m_draft + m_verify)`` seconds (one more sequence in draft pass ``j``, one more row of a
sequence already in verification), so at a goodput ``R`` it pays while
``A_bj S_bj >= R (m_draft + m_verify)``: that gives each sequence its horizon
``h_b``. A round of length ``L`` gives sequence ``b`` the cap ``min(L, h_b)``; every ``L`` from 1 to
the longest horizon is priced with the passes' fixed costs, so a round stops before the longest
horizon when its last passes carry too few rows to pay for themselves. ``R`` starts at plain
decoding's goodput and is raised to the best round's once (Dinkelbach's iteration). The best round
is taken if it beats plain decoding by the margin (below), otherwise every sequence drafts 0 and
the step decodes plainly; as a batch shrinks, rows cost less than a pass's fixed part and
speculation returns.

Catch-up. A draft model that is behind on a sequence (its prompt left to a catch-up pass, or
plain steps since its last round) must first fill in those positions. A round with any such
sequence pays a catch-up pass's fixed cost, and each sequence's catch-up rows are charged whole to
the round: it drafts only where its expected tokens in this round, net of their rows' cost at the
goodput ``R``, cover them. (Charged spread over the rounds a sequence was expected to have left,
the first priced round at batch 32 caught up every summary at once, about 25 ms of catch-up for
rounds whose later shares were never taken; charged whole, engines taking turns over 12 rounds:
the draft model's summaries at batch 8 0.957x -> 0.973x of plain decoding, at batch 32 0.942x ->
0.956x, scenes at batch 8 0.969x -> 0.976x, batch 1 within noise.) ``drafting_lately`` (the
smoothed share of recent steps that ran a round, from 0) tells a draft model whether to follow
prompts at prefill or leave them to catch-up.

Until it has timed ``EXPLORE`` verification passes and seen ``EXPLORE`` sequences' rounds (its
acceptance rates rest on no fewer) the controller explores: it drafts up to
``explore_length`` tokens a sequence (``EXPLORE_LENGTH`` unless the speculator asks for more; a
position not yet tried is expected to go as the deepest one tried, so longer drafts are tried where
acceptance is high). Early exit explores ``EARLY_EXIT_EXPLORE_LENGTH`` deep: every sequence runs
its first draft pass anyway and a deeper one costs a pass's fixed work, while two positions said
nothing of where drafts stop on confidence. (At batch 32 the summaries' first priced round, after
two positions accepted 86 % of the time, gave every sequence 24 drafts; they stopped after one or
two, and a round of 24 thin passes took 2-3 plain steps' time for 1.3-1.5 tokens a sequence.
Exploring four deep: paired over six rounds, summaries at batch 32 1.05-1.08x and scenes at batch 8
1.04-1.09x of exploring two, the other early-exit cells within noise; a draft model exploring four
deep caught up more at batch 32 and lost a tenth there.) Then, before it has timed a plain pass, it
decodes plainly: verification passes alone cannot tell their extra fixed cost from the intercept
they share with plain decoding (every one pays both), so the fit split the fixed cost between the
two and priced plain decoding at about half its fixed cost. Fresh engines at batch 8 chose plain
decoding at their first priced step, expecting 2.2-2.6 tokens a millisecond from plain steps that
then gave 1.1-1.4. A sequence that a draft model must first catch up drafts at most
``FRONTIER_GROWTH`` times as deep as any round has reached (``AcceptanceModel.reached``, at least
``explore_length``): its catch-up is paid for by the positions it is to draft, and depths no round
has seen are no evidence. (After the bench's warm-up request had run one round of 2 drafts, every
deeper position read as sure, and the first priced round at batch 8 caught up four reports to draft
24 for every sequence, priced at 25 tokens each; it yielded 2 to 17.) An over-long cap costs little
otherwise: a round's draft passes stop where its drafts do, and capping early exit's first rounds
the same way cost the batch-8 scenes a tenth of their speedup. With ``explore_sequences`` set it
explores with that many sequences only (a draft model must first fill in the K/V of every sequence
it drafts for; one sequence teaches the pass costs just as well, and a round priced from its
rates alone must still pay for every catch-up it runs: exploring with one sequence instead of
four, engines taking turns over 8 rounds, the draft model ran 1.02-1.05x faster at batches 8 and
32 and alike at batch 1). Plain
decoding's cost comes from the same fit as verification's (``speculative.costs``), so the exploring
rounds time it too and every round keeps it current.

Calibration. With ``calibrate`` (on by default, below) the engine times its passes before its
first request (``Engine``: made-up prompts decoded at batch sizes 1, 8 and 32, every step's length
given by ``script``) and the controller keeps those cost fits, forgetting everything else. An
engine that knows its passes' costs explores only where a draft that is always right would pay:
each exploring round is first priced as if every draft were proposed and accepted (``sure``), and
where not even that round beats plain decoding by the margin the step decodes plainly, a priced
plain decision held ``HOLD_MAX`` steps (Holding, below); a round that does explore is not held as a
priced one. So a batch too large for rounds to pay never runs the exploring round whose catch-up
and thin passes it would only lose to (the draft model's summaries at batches 8 and 32 drafted 2-4
tokens a run, 24 without calibration), and a fresh engine needs no plain step before it prices.
Paired with engines that learn their costs from their first rounds (``bench spec-compare``, 6
rounds, every cell): early exit's summaries at batch 8 1.05x, the draft model's summaries at 8 and
32 1.01-1.02x, but the draft model's scenes at batch 1 0.82x and at 32 0.95x, early exit's
summaries at 32 and scenes at 8 0.98x, the rest within 1 %. Most likely: a draft model's first
round on a sequence must catch up its prompt, charged whole to that round (Catch-up, above): with
the catch-up's cost known from the start no round pays for it, the sequence decodes plainly and its
draft falls further behind, where an engine still learning its costs has an empty catch-up fit and
goes ahead. Hence off by default until a catch-up can be paid for by the sequence's later rounds
(spread over the tokens the sequence has left, the first priced rounds of the draft model's
summaries at batch 32 caught up every report again). With ``stay_margin`` 1, below, the batch-1
scenes lose nothing: ``bench spec-compare --set calibrate=1 --set stay_margin=1.0``, 6 rounds,
every cell, two runs: early exit's summaries at batch 8 1.07-1.09x and at 32 1.03-1.09x, its scenes
at 32 1.04-1.06x, the draft model's summaries at 32 1.03-1.06x, the others within 1-2 % but the
draft model's scenes at 32, 0.97x in both: there the first priced round, after one sequence
explored with every draft accepted, catches up all 32 scenes to draft 6 each, most stop unsure at
their first, and calibrated from text prompts the rounds after it are priced at about break-even
and go on, where an engine still learning decodes plainly. Those two runs had the stay margin on
``rounds_share`` alone; with the size-class rule below, one run of the draft model's cells read
1.03 / 1.00 / 1.01x on the summaries and 0.93 / 1.04 / 0.98x on the scenes at batches 32 / 8 / 1.
The scenes at 32 set ``min_speedup`` then, so both stayed off.) The width rule below keeps that
first round to a few sequences, and with it both are on by default. Measured before they were
(``bench spec-compare --set calibrate=1 --set stay_margin=1.0 --set width_growth=3`` against an
engine with none of the three, engines taking turns over 16 rounds): the draft model's scenes at
batch 1 / 32 1.00x / 1.02x, its summaries at 32 1.05x, early exit's summaries at 8 1.07x;
calibrated without the width rule, the draft model's scenes at 32 0.97x; over 6 rounds every other
cell within 2 % (0.99-1.02x). Calibration takes about a second when the engine starts (the bundled
pair: 1.4 s for early exit, 0.8 s for the draft model).

Width. A round drafts for at most ``WIDTH_GROWTH`` times as many sequences as the engine-wide rates
rest on (``AcceptanceModel.proposed``'s decayed count of sequence-rounds at the first position),
those with the most net tokens (expected accepted tokens less their rows' and catch-up's cost at
the goodput ``R``): a draft model explores with one sequence, so its first priced round after it
drafts for 5 sequences at most and the next for about 20, each teaching the rates more than the one
before. Depths no round has seen are no evidence (``FRONTIER_GROWTH``, above), and neither is one
sequence's round for 32 others. A controller that is not to explore (``explore`` 0) prices from
the prior alone and is not held to a width.

The margin. A round is taken only when it promises ``ROUND_MARGIN`` times plain decoding's
goodput: what the model leaves out (the slots a round reserves, the rates' and fits' noise)
costs a round a few per cent, so a round priced at break-even is a loss measured. (The engine's
work on a round's verdicts is in the verification pass's time, as the same work is in a plain
step's.) With ``stay_margin`` below ``ROUND_MARGIN`` (1 by default), rounds that run go on
at that margin while at least ``STAYING`` of recent steps ran rounds (``rounds_share``) and the
batch is in the size class of the last step that ran one or a smaller class. Why: a draft model
that stops drafting falls behind, its next round must first catch up what it skipped (Catch-up,
above), and nothing a plain step teaches moves the rates or the draft's costs, so one plain
decision priced a hair under the margin (1.09x at the draft model's batch-1 scenes, a cost fit's
noise) kept every later round from paying and the engine decoded plainly to the end of the run:
123 drafts in such a run against 241 in another, the controller at 1.18x of plain decoding where
fixed rounds ran 1.41x. A batch grown into a larger class is priced at the margin again (a batch
of 32 after its last sequence's rounds). Alone (``--set stay_margin=1.0``, every cell) it moved no
cell beyond 1.5 %; it is what lets calibration keep the batch-1 scenes (Calibration, above), and
it is on with calibration.

Holding. Planning costs about 0.3 ms inside the engine (tens of small array operations, run with
the caches full of the model's weights): a quarter of a batch-1 step of the bundled model, a sixth
of a batch-8 one. So a priced decision to decode plainly is kept without planning for the next
steps while the batch stays in its size class (1, 2-3, 4-7, 8-15, ...) or a larger one (a round
pays less the more rows verification carries). Each class keeps its own span: 1 step after its
first plain decision, doubling with every one that follows up to ``HOLD_MAX``; ``HOLD_MAX`` at once
when not even a draft that is always right would pay (no acceptance can change that), or when
the best it priced promised less than ``1 - HOLD_GAP`` of the margin (a round, or where none
was priced, the best first draft's tokens per second of its rows, over plain decoding's
goodput): while the step decodes plainly no rate moves, so only its costs drifting by more than
that could turn it, and the draft model's scenes at batch 32 priced 0.85, 0.76, 0.72, 0.68, 0.65,
0.61x in one run, every step of it further away (its sequences' ends nearer). Held so, 2-3
priced steps a run there instead of 8-9, about 0.7 ms each inside the engine; ``bench
spec-compare --set hold_gap=1.0`` (no such hold) against it, 8 rounds: the draft model's scenes
at batches 32 and 8 0.995x and 0.987x, the other cells tried within 1 %. A priced
round in a class starts that class's span again at 1 (rounds pay there now, so a return to plain
decoding is checked soon), and leaves the other classes' alone (the rounds a batch's last few
sequences run as it drains do not cost the next full batch its long hold). A batch in a smaller
class ends the hold and is priced at once, and so does a batch that a sequence has joined since
(every token of a new sequence lies ahead, where the decision may have been made for sequences near
their ends: a batch's last summaries, a few tokens from theirs, chose plain decoding, and the next
batch's fresh ones inherited it for up to 64 steps of rounds that paid). Nothing a plain step
teaches the controller but plain decoding's cost changes while it holds, so a workload that starts
to pay at the same batch size and the same sequences waits at most ``HOLD_MAX`` steps for its first
round. A priced round's lengths are held the same way while no sequence has joined the batch
(each clipped to its limit; those left when others end keep theirs, unless none of them drafts):
1 round, then 2, up to ``ROUND_HOLD_MAX`` while pricing keeps choosing the same sequences to draft
(among those still there), 1 again when it chooses others (a re-check that lets a sequence whose
drafts were rejected draft again is held for one round, not four); a round moves a sequence's rates
by one observation against the ten or so its decayed counts weigh, and at batch 1 planning every
round cost 7 % of the bundled model's summaries. A priced decision costs 0.4-0.7 ms inside the
engine, about 5 % of a batch-1 run of the bundled pair at ``ROUND_HOLD_MAX`` 4: held up to 16
rounds instead (``bench spec-compare --set round_hold_max=16``, 6 rounds each, two runs over every
cell) the draft model's batch-1 scenes ran 1.04-1.06x, early exit's batch-32 summaries 1.01-1.04x
and no cell below 0.99x (up to 8: 0.96-1.02x; up to 64: 0.99-1.03x). A round is held only while
the engine-wide rates rest on at least ``ROUND_HOLD_EVIDENCE`` times the observations it adds (one
per drafting sequence); before that its outcome can move them far, and the next step is priced.
(At batch 32 the draft model's first priced round, after an exploring round of four sequences
whose drafts were all accepted, gave all 32 sequences 6 drafts; every one stopped unsure at its
first, and the held round after it cost about 10 ms more than plain steps. Paired over 8 rounds:
draft model scenes at batch 32 1.03x, early exit summaries at batch 8 1.06x over 6, the other cells
tried within noise.) Before a round's lengths outlived the sequences that ended, every ending
ended the hold and restarted its span: early exit's summaries at batch 8 priced about 15 steps a
run, batch 32 about 6. Kept by those left, engines taking turns over 6 rounds against the rule
before: priced steps 89 -> 71 and 34 -> 18, 1.004x and 1.033x; early exit's scenes at 8 1.02x and
the draft model's at 8 1.007x (priced 125 -> 104).

The constants below (``EXPLORE``, ``FRONTIER_GROWTH``, ``WIDTH_GROWTH``, the margins, the holds' and
``PREFILL_DRAFT_SHARE``) are the defaults of ``Settings``, which a controller may be given
instead: ``python -m mmkv.bench spec-compare --set NAME=VALUE`` measures such a change against
the defaults.

A draft length chosen from past rounds only (never from the round's own outcomes) leaves
verification exact.

Invariant: a chosen length is in ``[0, limit]``; with ``fixed`` it is the limit.
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

EXPLORE = 2
EXPLORE_LENGTH = 2  # the most an exploring round drafts, unless the speculator asks for more
EARLY_EXIT_EXPLORE_LENGTH = 4  # ... for early exit (the module docstring)
FRONTIER_GROWTH = 3  # a sequence caught up drafts at most this x as deep as any round has reached
WIDTH_GROWTH = 3  # a round drafts for at most this x the sequence-rounds the rates rest on
ROUND_MARGIN = 1.1  # a round must promise this x plain decoding's goodput
STAY_MARGIN = 1.0  # ... while STAYING of recent steps ran rounds (the module docstring)
STAYING = 0.5  # the share of recent steps that ran rounds from which the stay margin applies
HOLD_MAX = 64  # the most steps a priced plain decision is held
HOLD_GAP = 0.2  # ... at once, if the best it priced fell short of the margin by more than this share
ROUND_HOLD_MAX = 16  # the most rounds a priced round's lengths are held
ROUND_HOLD_EVIDENCE = 1.0  # ... only if the rates rest on this x the observations the round adds
HISTORIES_KEPT = 4096  # sequences whose mean draft length the stats summarise
ROUNDS_SMOOTHING = 0.1  # weight of the latest step in ``rounds_share``
PREFILL_DRAFT_SHARE = 0.2  # the draft model follows prompts while rounds_share is at least this
CALIBRATE = 1  # the engine times its passes when it starts (the module docstring)


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
        decision needs neither: at batch 32 building them took about a third of a held step's
        planning)."""
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
            return [0] * len(limits)  # time a plain pass before pricing (the module docstring)
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

