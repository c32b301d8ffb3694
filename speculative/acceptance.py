"""How often drafts get proposed and accepted, per position in the round, engine-wide and smoothed.

At position ``j`` (1-based), ``proposed``: the draft proposes token ``j`` given it proposed
``j - 1``; ``accepted``: the target accepts it given ``j - 1`` accepted. Each is a decayed count
of hits over trials, shrunk toward position ``j - 1``'s rate (the first toward 1) with the weight of
``PRIOR`` trials. Rates are kept per sampling regime (greedy, or a temperature and top-p): the
rejection sampler accepts a sampled draft less often than greedy verification does. A batch is
priced on its sequences' own rounds, pooled, with their regimes' rates weighing ``BATCH_PRIOR``
trials (``batch_rates``), so scenes left after report summaries end go by their own drafts.

Invariant: every rate is in ``[0, 1]``; a regime's rates rest on its own rounds only.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Hashable

import numpy as np

DECAY = 0.98  # per sequence-round observed
PRIOR = 1.0  # trials' weight of the position before (the first: of rate 1) in a position's rate
BATCH_PRIOR = 4.0  # trials' weight of the engine's rate in a batch's


def regime(temperature: float, top_p: float) -> Hashable:
    """The sampling regime whose rounds a sequence's are pooled with: greedy, or its temperature
    and top-p (rounded, so near-equal settings share their rates)."""
    return "greedy" if temperature == 0 else (round(temperature, 2), round(top_p, 2))


@dataclass(slots=True)
class DraftHistory:
    """What one sequence drafted: the steps decided for it, the drafts it proposed, its rounds'
    counts, and the regime it samples in."""

    decisions: int = 0
    drafted: int = 0
    counts: np.ndarray | None = None  # hits and trials of proposing, of accepting: [4, positions]
    regime: Hashable = "greedy"


@dataclass(slots=True)
class RegimeRates:
    """One regime's decayed counts (laid out as a history's) and the sequence-rounds behind them."""

    counts: np.ndarray
    rounds: int = 0
    chains: tuple | None = None  # (rounds, proposed, accepted) as last derived


def _outcomes(positions: int, proposed: int, accepted: int, confidence_stop: bool) -> np.ndarray:
    """One round's hits and trials by position: proposing ran through ``proposed`` drafts and
    failed at the next one if the confidence threshold stopped it; accepting ran through
    ``accepted`` and failed at the next one if a proposed draft was rejected."""
    counts = np.zeros((4, positions))
    for row, hits, trials in ((0, proposed, proposed + confidence_stop),
                              (2, accepted, accepted + (accepted < proposed))):
        counts[row, :hits] = counts[row + 1, :trials] = 1.0
    return counts


def _chain(hits: np.ndarray, trials: np.ndarray) -> list[float]:
    """The rate at every position, each shrunk toward the one before it (the first toward 1)."""
    rates, before = [], 1.0
    for hit, trial in zip(hits.tolist(), trials.tolist()):
        before = (hit + PRIOR * before) / (trial + PRIOR)
        rates.append(before)
    return rates


@dataclass(slots=True)
class AcceptanceModel:
    """The engine's rates by regime, with the observations they rest on."""

    positions: int
    regimes: dict[Hashable, RegimeRates] = field(default_factory=dict)

    def _of(self, key: Hashable) -> RegimeRates:
        if key not in self.regimes:
            self.regimes[key] = RegimeRates(np.zeros((4, self.positions)))
        return self.regimes[key]

    def rounds(self, histories: list[DraftHistory]) -> int:
        """The fewest sequence-rounds any of these sequences' regimes rests on."""
        return min((self._of(h.regime).rounds for h in histories), default=0)

    def observe(self, history: DraftHistory, chosen: int, proposed: int, accepted: int,
                confidence_stop: bool) -> None:
        """A round in which the sequence was allowed ``chosen`` drafts, proposed ``proposed``
        (fewer when its confidence fell below the threshold, or it drafted a token ending it) and
        the target accepted ``accepted`` of them (the rejection sampler's verdict, if sampled)."""
        history.drafted += proposed
        if chosen == 0:
            return
        outcomes = _outcomes(self.positions, proposed, accepted, confidence_stop)
        rates = self._of(history.regime)
        rates.rounds += 1
        rates.counts = rates.counts * DECAY + outcomes
        history.counts = outcomes if history.counts is None else history.counts + outcomes

    def rates(self, limit: int, key: Hashable = "greedy") -> tuple[list[float], list[float]]:
        """Regime ``key``'s ``proposed`` and ``accepted`` rates at positions ``1..limit`` (derived
        once per observation)."""
        rates = self._of(key)
        if rates.chains is None or rates.chains[0] != rates.rounds:
            counts = rates.counts
            rates.chains = (rates.rounds, _chain(counts[0], counts[1]), _chain(counts[2], counts[3]))
        return rates.chains[1][:limit], rates.chains[2][:limit]

    def batch_rates(self, histories: list[DraftHistory], limit: int) -> tuple[list[float], list[float]]:
        """The rates of a batch of sequences with these ``histories``: their regimes' (each by
        how many sequences it has), moved toward the rounds the sequences drafted themselves."""
        regimes = Counter(h.regime for h in histories) or Counter(["greedy"])
        engine = (sum(n * np.array(self.rates(limit, key)) for key, n in regimes.items())
                  / sum(regimes.values()))
        counted = [h.counts[:, :limit] for h in histories if h.counts is not None]
        if not counted:
            return engine[0].tolist(), engine[1].tolist()
        hits = np.sum(counted, axis=0)
        return tuple(((hits[2 * k] + BATCH_PRIOR * engine[k]) / (hits[2 * k + 1] + BATCH_PRIOR)).tolist()
                     for k in range(2))
