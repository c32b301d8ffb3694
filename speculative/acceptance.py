"""How often drafts get proposed and accepted, per position in the round, engine-wide and smoothed.

For position ``j`` (the ``j``-th draft token, 1-based): ``proposed``, the draft proposes token ``j``
given it proposed ``j - 1`` (below 1 when the confidence threshold stops drafting or a draft ends
its sequence); ``accepted``, the target accepts it given it was proposed and ``j - 1`` accepted.
Each is a decayed count of hits over trials, shrunk toward the rate of position ``j - 1`` (the first
toward 1) with the weight of ``PRIOR`` trials, so a position no round has reached goes as the
deepest one reached. A rate is conditional on reaching its position.

A batch is priced on its sequences' rounds, pooled, the engine's rate weighing ``BATCH_PRIOR``
trials (``batch_rates``): scenes left after report summaries end go by their own drafts.

Invariant: every rate is in ``[0, 1]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

DECAY = 0.98  # per sequence-round observed
PRIOR = 1.0  # trials' weight of the position before (the first: of rate 1) in a position's rate
BATCH_PRIOR = 4.0  # trials' weight of the engine's rate in a batch's


@dataclass(slots=True)
class DecayedRate:
    """Decayed hits and trials per position."""

    hits: list[float]
    trials: list[float]

    @classmethod
    def empty(cls, positions: int) -> DecayedRate:
        return cls([0.0] * positions, [0.0] * positions)

    def observe(self, outcomes: list[bool], decay: float) -> None:
        """One round's outcomes at positions 1, 2, ... (as far as the round reached)."""
        self.hits = [h * decay for h in self.hits]
        self.trials = [t * decay for t in self.trials]
        for j, hit in enumerate(outcomes):
            self.trials[j] += 1.0
            self.hits[j] += hit

    def chain(self) -> list[float]:
        """The rate at every position, each shrunk toward the one before it."""
        rates, before = [], 1.0
        for hits, trials in zip(self.hits, self.trials):
            before = (hits + PRIOR * before) / (trials + PRIOR)
            rates.append(before)
        return rates


@dataclass(slots=True)
class DraftHistory:
    """What one sequence drafted: the steps decided for it, the drafts it proposed, its rounds."""

    decisions: int = 0
    drafted: int = 0
    counts: np.ndarray | None = None  # hits, trials of proposing; of accepting [4, positions]


@dataclass(slots=True)
class AcceptanceModel:
    """The engine's rates, with the observations they rest on."""

    positions: int
    version: int = 0  # sequence-rounds observed
    proposed: DecayedRate = field(init=False)
    accepted: DecayedRate = field(init=False)
    _rates: tuple | None = field(init=False, default=None)  # (version, proposed, accepted arrays)

    def __post_init__(self) -> None:
        self.proposed = DecayedRate.empty(self.positions)
        self.accepted = DecayedRate.empty(self.positions)

    def observe(self, history: DraftHistory, chosen: int, proposed: int, accepted: int,
                confidence_stop: bool) -> None:
        """A round in which the sequence was allowed ``chosen`` drafts, proposed ``proposed``
        (fewer when its confidence fell below the threshold, or it drafted a token ending it) and
        the target accepted ``accepted`` of them."""
        history.drafted += proposed
        if chosen == 0:
            return
        self.version += 1
        history.counts = np.zeros((4, self.positions)) if history.counts is None else history.counts
        for row, rate, outcomes in ((0, self.proposed, [True] * proposed + [False] * confidence_stop),
                                    (2, self.accepted, [True] * accepted + [False] * (accepted < proposed))):
            rate.observe(outcomes, DECAY)
            history.counts[row, :sum(outcomes)] += 1.0  # its hits (a run from the first position)
            history.counts[row + 1, :len(outcomes)] += 1.0  # its trials

    def rates(self, limit: int) -> tuple[list[float], list[float]]:
        """The ``proposed`` and ``accepted`` rates at positions ``1..limit`` (derived once per
        observation)."""
        if self._rates is None or self._rates[0] != self.version:
            self._rates = (self.version, self.proposed.chain(), self.accepted.chain())
        return self._rates[1][:limit], self._rates[2][:limit]

    def batch_rates(self, histories: list[DraftHistory], limit: int) -> tuple[list[float], list[float]]:
        """``rates`` for a batch of sequences with these ``histories`` (the engine's where none drafted)."""
        proposed, accepted = self.rates(limit)
        counted = [h.counts[:, :limit] for h in histories if h.counts is not None]
        if not counted:
            return proposed, accepted
        hits = np.sum(counted, axis=0)
        return tuple(((hits[2 * k] + BATCH_PRIOR * np.array(engine)) / (hits[2 * k + 1] + BATCH_PRIOR)).tolist()
                     for k, engine in enumerate((proposed, accepted)))
