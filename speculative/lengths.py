"""How far running sequences will still go, from how long recent outputs ran.

A hard limit overstates what most generate (a summary allowed 48 tokens ends at about 25). The
chance that a sequence which has generated ``g`` tokens runs ``i >= 1`` past its next one
(``survival``) is a product-limit (Kaplan-Meier) estimate: for each length ``m`` from ``g + 1`` on,
one less the share of outputs reaching ``m`` that ended there, where the batch's running
sequences reach what they have generated (so scenes running beside ended summaries are not
expected to end with them). Past every output that reached a length, a sequence ends at the
recorded outputs' rate; with nothing recorded the chance is 1.

Invariant: ``survival`` is 1 at ``i = 0`` and never rises with ``i``.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import deque

KEPT = 256  # recent output lengths the estimate reads


class OutputLengths:
    def __init__(self, kept: int = KEPT) -> None:
        self.recent: deque[int] = deque(maxlen=kept)
        self._sorted: list[int] | None = None  # the recent lengths in order (None: stale)

    def record(self, generated: int) -> None:
        """A sequence finished after generating ``generated`` tokens."""
        self.recent.append(generated)
        self._sorted = None

    def survival(self, generated: list[int], positions: int) -> dict[int, list[float]]:
        """For each count in ``generated`` (the tokens each sequence of a batch has generated),
        ``positions + 1`` chances: the ``i``-th that such a sequence generates ``i`` more after
        its next one. Scalar loops, once per distinct count: a batch holds few, and at a few dozen
        lengths numpy's per-call cost outweighs the arithmetic."""
        if not self.recent:
            return {g: [1.0] * (positions + 1) for g in generated}
        if self._sorted is None:
            self._sorted = sorted(self.recent)
        done, running, rows = self._sorted, sorted(generated), {}
        hazard = len(done) / max(sum(done), len(done))  # past every output that reached m: their rate
        for g in set(running):
            row = rows[g] = [1.0]
            chance = 1.0
            for m in range(g + 1, g + positions + 1):
                first = bisect_left(done, m)  # recent outputs shorter than m
                reached = len(done) - first + len(running) - bisect_left(running, m)  # and running ones
                chance *= 1.0 - (bisect_right(done, m, first) - first) / reached if reached else 1.0 - hazard
                row.append(chance)
        return rows
