"""How often a sequence's drafts get proposed and accepted, per position in the round, smoothed.

For position ``j`` of a round (the ``j``-th draft token, 1-based) two conditional rates:

* ``proposed``: the draft proposes token ``j`` given it proposed token ``j - 1`` (below 1 only
  when a confidence threshold stops drafting: the draft's own estimate of acceptance);
* ``accepted``: the target accepts token ``j`` given it was proposed and ``j - 1`` was accepted.

Each is a decayed count of hits over trials (a round's outcomes weigh ``1``, the previous round's
``decay``, and so on), shrunk toward the engine-wide rate of that position with the weight of
``SHRINK`` trials. The engine-wide rate of position ``j`` is shrunk toward that of position
``j - 1`` (the first toward 1) with the weight of ``PRIOR`` trials: a first draft is tried, and a
position no round has reached is expected to go as the deepest one reached. (Shrunk toward 1
instead, every untried position would promise a proposal and an acceptance, and long rounds would
be priced far above what they yield.) Positions a round did not reach are not observed: a rate is
conditional on reaching its position.

Invariant: every rate is in ``[0, 1]``; an observation changes only its sequence's counts and the
engine-wide ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

SEQUENCE_DECAY = 0.9  # per round of the sequence
ENGINE_DECAY = 0.98  # per sequence-round observed engine-wide
SHRINK = 0.5  # trials' weight of the engine-wide rate in a sequence's rate
PRIOR = 1.0  # trials' weight of the optimistic prior (rate 1) in the engine-wide rate


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
        if decay != 1.0:
            self.hits = [h * decay for h in self.hits]
            self.trials = [t * decay for t in self.trials]
        for j, hit in enumerate(outcomes):
            self.trials[j] += 1.0
            self.hits[j] += hit


@dataclass(slots=True)
class DraftHistory:
    """One sequence's drafting record: its smoothed rates and what it drafted."""

    proposed: DecayedRate
    accepted: DecayedRate
    decisions: int = 0  # steps the controller chose a draft length for it
    drafted: int = 0  # draft tokens proposed over those steps
    shrunk: tuple | None = None  # (version, proposed, accepted): its rates at that model version


@dataclass(slots=True)
class AcceptanceModel:
    """Engine-wide rates and every sequence's history."""

    positions: int
    version: int = 0  # counts observations: rates derived at an older version are stale
    reached: int = 0  # the deepest position any round has tried
    proposed: DecayedRate = field(init=False)
    accepted: DecayedRate = field(init=False)
    _engine: tuple | None = field(init=False, default=None)  # (version, engine_rates() as arrays)

    def __post_init__(self) -> None:
        self.proposed = DecayedRate.empty(self.positions)
        self.accepted = DecayedRate.empty(self.positions)

    def new_history(self) -> DraftHistory:
        return DraftHistory(DecayedRate.empty(self.positions), DecayedRate.empty(self.positions))

    def observe(self, history: DraftHistory, chosen: int, proposed: int, accepted: int,
                confidence_stop: bool) -> None:
        """A round in which the sequence was allowed ``chosen`` drafts, proposed ``proposed``
        (fewer when its confidence fell below the threshold, or it drafted a token ending it) and
        the target accepted ``accepted`` of them."""
        history.drafted += proposed
        if chosen == 0:
            return
        self.version += 1
        went_on = [True] * proposed + ([False] if confidence_stop else [])
        kept = [True] * accepted + ([False] if accepted < proposed else [])
        self.reached = max(self.reached, len(went_on))
        for mine, everyone, outcomes in ((history.proposed, self.proposed, went_on),
                                         (history.accepted, self.accepted, kept)):
            mine.observe(outcomes, SEQUENCE_DECAY)
            everyone.observe(outcomes, ENGINE_DECAY)

    def engine_rates(self) -> tuple[list[float], list[float]]:
        """The engine-wide ``proposed`` and ``accepted`` rates at every position, each shrunk
        toward the one before it."""
        rates = []
        for counts in (self.proposed, self.accepted):
            chain, before = [], 1.0
            for hits, trials in zip(counts.hits, counts.trials):
                before = (hits + PRIOR * before) / (trials + PRIOR)
                chain.append(before)
            rates.append(chain)
        return rates[0], rates[1]

    def rates(self, histories: list[DraftHistory], limit: int) -> tuple[np.ndarray, np.ndarray]:
        """The sequences' ``proposed`` and ``accepted`` rates at positions ``1..limit`` as rows
        of two ``[len(histories), limit]`` arrays, each shrunk toward the engine-wide rate
        (``engine_rates()``; a sequence with no round of its own has the engine's). Those not
        derived at this ``version`` are derived in one pass over them and kept with their
        history: no rate moves between two observations, so steps priced while the batch
        decodes plainly read them all from there instead of deriving them again."""
        version = self.version
        stale = [h for h in histories if h.shrunk is None or h.shrunk[0] != version]
        if stale:
            if self._engine is None or self._engine[0] != version:
                self._engine = (version, *(np.asarray(r) for r in self.engine_rates()))
            derived = []
            for which, everyone in ((0, self._engine[1]), (1, self._engine[2])):
                counts = [(h.proposed, h.accepted)[which] for h in stale]
                hits = np.array([c.hits for c in counts], dtype=np.float64)
                trials = np.array([c.trials for c in counts], dtype=np.float64)
                derived.append((hits + SHRINK * everyone) / (trials + SHRINK))
            for h, proposed, accepted in zip(stale, *derived):
                h.shrunk = (version, proposed, accepted)
        return (np.array([h.shrunk[1] for h in histories]).reshape(len(histories), -1)[:, :limit],
                np.array([h.shrunk[2] for h in histories]).reshape(len(histories), -1)[:, :limit])
