"""How many tokens a running sequence will still generate, from how long recent outputs ran.

A sequence's hard limit (``max_tokens`` less what it generated) overstates what most sequences
generate: a summary asked for at most 48 tokens ends at about 25, by its end-of-sequence token.
A draft model that fell behind on a sequence must fill in its K/V before drafting, and the
controller spreads that catch-up over the rounds the sequence has left; counted from the hard
limit, a sequence two tokens from its end looked ten rounds from it, and the catch-up passes of a
batch's last sequences were paid for a token or two each.

The estimate for a sequence that has generated ``g`` tokens, with at most ``cap`` more: the mean
of ``L - g`` over the recent outputs' lengths ``L`` that ran past ``g`` (how much further outputs
that got this far went) and one more output that ends after the sequence's next token, clipped
to ``[1, cap]``. The chance that it is still running ``i >= 1`` tokens after its next one
(``survival``): of those same outputs, the share that ran to ``g + 1 + i`` or further. A round
prices its drafts with it: a summary two tokens from its end gets nothing from a draft of eight
(rounds of a batch's last summaries were priced at 8-12 tokens and yielded 2).

The extra output is the sequence's own chance of ending now. Without it a sequence that has run
past every recent output's end (the longest of a batch) was expected to run to its limit: the
last two summaries of each batch drafted behind a catch-up over their whole reports, priced at 5
tokens each, and ended at once. With nothing recorded (a fresh engine) the estimates are ``cap``
and 1.

Invariant: ``1 <= expected_left(g, cap) <= cap`` for ``cap >= 1``; ``survival`` is 1 at ``i = 0``
and falls with ``i``, below 1 after ``i = 0`` once an output is recorded; each estimate costs one
binary search (the sorted lengths and their suffix sums are rebuilt after a record, on the next
estimate).
"""

from __future__ import annotations

import bisect
from collections import deque

import numpy as np

KEPT = 256  # recent output lengths the estimate reads


class OutputLengths:
    def __init__(self, kept: int = KEPT) -> None:
        self.recent: deque[int] = deque(maxlen=kept)
        self._sorted: list[int] | None = None
        self._array = np.zeros(0, dtype=np.int64)  # _sorted as an array
        self._suffix: list[int] = []  # _suffix[i]: the sum of _sorted[i:]

    def record(self, generated: int) -> None:
        """A sequence finished after generating ``generated`` tokens."""
        self.recent.append(generated)
        self._sorted = None

    def expected_left(self, generated: int, cap: int) -> int:
        if not self.recent:
            return cap
        self._sort()
        first = bisect.bisect_right(self._sorted, generated)  # the outputs that ran past it
        past = len(self._sorted) - first
        overrun = self._suffix[first] - past * generated + 1  # and one output ending next token
        return max(1, min(cap, round(overrun / (past + 1))))

    def survival(self, generated: list[int], positions: int) -> np.ndarray:
        """``[len(generated), positions + 1]``: column ``i`` is the chance that a sequence which
        has generated ``generated[b]`` tokens generates ``i`` more after its next one."""
        if not self.recent:
            return np.ones((len(generated), positions + 1))
        self._sort()
        ran = np.asarray(generated)[:, None] + np.arange(1, positions + 2)  # [B, positions + 1]
        reached = len(self._sorted) - np.searchsorted(self._array, ran)  # outputs of at least that
        running = reached / (reached[:, :1] + 1.0)  # and one output that ends after the next token
        running[:, 0] = 1.0
        return running

    def _sort(self) -> None:
        if self._sorted is None:
            self._sorted = sorted(self.recent)
            self._array = np.asarray(self._sorted)
            self._suffix = [0] * (len(self._sorted) + 1)
            for i in range(len(self._sorted) - 1, -1, -1):
                self._suffix[i] = self._suffix[i + 1] + self._sorted[i]
