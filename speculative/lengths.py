"""How far running sequences will still go, from how long recent outputs ran.

A sequence's hard limit (``max_tokens`` less what it generated) overstates what most sequences
generate: a summary asked for at most 48 tokens ends at about 25, by its end-of-sequence token. The
chance that a sequence which has generated ``g`` tokens is still running ``i >= 1`` tokens after
its next one (``survival``): of the recent outputs that ran past ``g`` and one more output that
ends after the sequence's next token, the share that ran to ``g + 1 + i`` or further. A round
prices its drafts with it: a summary two tokens from its end gets nothing from a draft of eight.

The extra output is the sequence's own chance of ending now, so a sequence that has run past every
recent output's end (the longest of a batch) is not expected to run to its limit. With nothing
recorded (a fresh engine) the chance is 1.

Invariant: ``survival`` is 1 at ``i = 0`` and falls with ``i``, below 1 after ``i = 0`` once an
output is recorded; the sorted lengths are rebuilt after a record, on the next estimate.
"""

from __future__ import annotations

from collections import deque

import numpy as np

KEPT = 256  # recent output lengths the estimate reads


class OutputLengths:
    def __init__(self, kept: int = KEPT) -> None:
        self.recent: deque[int] = deque(maxlen=kept)
        self._sorted: np.ndarray | None = None  # the recent lengths in order (None: stale)

    def record(self, generated: int) -> None:
        """A sequence finished after generating ``generated`` tokens."""
        self.recent.append(generated)
        self._sorted = None

    def survival(self, generated: list[int], positions: int) -> np.ndarray:
        """``[len(generated), positions + 1]``: column ``i`` is the chance that a sequence which
        has generated ``generated[b]`` tokens generates ``i`` more after its next one."""
        if not self.recent:
            return np.ones((len(generated), positions + 1))
        if self._sorted is None:
            self._sorted = np.sort(np.fromiter(self.recent, dtype=np.int64))
        ran = np.asarray(generated)[:, None] + np.arange(1, positions + 2)  # [B, positions + 1]
        reached = len(self._sorted) - np.searchsorted(self._sorted, ran)  # outputs of at least that
        running = reached / (reached[:, :1] + 1.0)  # and one output that ends after the next token
        running[:, 0] = 1.0
        return running
