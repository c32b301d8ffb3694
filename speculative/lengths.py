"""How far running sequences will still go, from how long recent outputs ran.

A sequence's hard limit (``max_tokens`` less what it generated) overstates what most sequences
generate: a summary asked for at most 48 tokens ends at about 25, by its end-of-sequence token. The
chance that a sequence which has generated ``g`` tokens is still running ``i >= 1`` tokens after
its next one (``survival``) is a product-limit (Kaplan-Meier) estimate: for each length ``m`` from
``g + 1`` on, the chance of going past ``m`` is one less the share of the outputs that reached
``m`` and ended there. Two kinds of output reached ``m``: recent outputs at least ``m`` long, and
sequences of the batch being priced that have already generated ``m`` tokens (still running, so
none of them ended there). Counting the running ones matters where a batch's outputs differ in
length: the first outputs to end are the short ones, and from them alone a batch of scene
descriptions beside report summaries would look as if every scene ended when the summaries did.

Past every output that reached a length, nothing says where a sequence ends; there it ends at the
recorded outputs' rate (a constant hazard: as many ends as they had, over the tokens they ran), so
the last of a batch of short answers is expected to end soon and a scene description still
running after a mixed batch's summaries ended is expected to run on. With nothing recorded (a
fresh engine) the chance is 1.

Invariant: ``survival`` is 1 at ``i = 0`` and never rises with ``i``; the sorted lengths are
rebuilt after a record, on the next estimate.
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
        """``[len(generated), positions + 1]``: column ``i`` is the chance that a sequence of a
        batch whose sequences have generated ``generated`` tokens generates ``i`` more after its
        next one."""
        if not self.recent:
            return np.ones((len(generated), positions + 1))
        if self._sorted is None:
            self._sorted = np.sort(np.fromiter(self.recent, dtype=np.int64))
        done, generated = self._sorted, np.asarray(generated, dtype=np.int64)
        running = np.sort(generated)
        lengths = generated[:, None] + np.arange(1, max(positions, 1) + 1)
        at_least = len(done) - np.searchsorted(done, lengths)  # recent outputs at least m long
        ended = at_least - (len(done) - np.searchsorted(done, lengths + 1))  # ... exactly m long
        reached = at_least + len(running) - np.searchsorted(running, lengths)  # and running ones
        hazard = len(done) / max(float(done.sum()), len(done))  # past every output that reached m: their rate
        past = np.where(reached > 0, 1.0 - ended / np.maximum(reached, 1), 1.0 - hazard)  # going past m
        return np.concatenate([np.ones((len(lengths), 1)), np.cumprod(past, axis=1)],
                              axis=1)[:, :positions + 1]
