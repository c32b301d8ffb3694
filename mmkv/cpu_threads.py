"""How many intra-op threads a decoding step runs on, on the CPU: chosen from measured step times.

A decoding step reads every weight once for a few rows of activations, so it is bound by memory
bandwidth and a last core adds less to it than to a prefill GEMM; and when something else wants a
core (the server's HTTP front, clients on the same machine, other processes), an OpenMP team that
spans every core waits at each barrier for whichever member the OS scheduled out, and one fewer
thread can then be faster.

So a decoding step (plain, or a speculative round, whose draft passes run one row a sequence and
whose verification a few) runs on every core (``wide``) or on one fewer (``narrow``), whichever
measures faster: the count in use is ``chosen``; every ``explore_every``-th decoding step that
follows one on ``chosen`` of the same shape (the engine's: the batch size, and whether a round)
runs on the other count, and the log of its time over that previous step's is smoothed into
``log_ratio`` (the other count's time relative to ``chosen``'s): the mean of the samples while
there are fewer than ``1 / smoothing``, exponentially smoothed after. When the estimate, resting
on at least ``settle_after`` samples, says the other count is faster by more than ``margin``, it
becomes ``chosen``. Steps with prompt tokens always take every core: their GEMMs are
compute-bound.

Why not one sample: a sample compares two single steps, and once settled the samples come only
every ``settle_every`` steps, so a switch made on one noisy sample would hold for most of a run.

Invariant: the thread count changes only between steps, and is every core again whenever the
engine has nothing left to run; results differ between counts only by floating-point summation
order. What these rules measured: docs/attention-and-kernels.md (Decode threads on the CPU).
"""

from __future__ import annotations

import math
import time
from typing import Callable, Hashable

import torch


class DecodeThreads:
    """The decoding steps' intra-op thread count for one engine (``cores`` >= 2)."""

    def __init__(self, cores: int, explore_every: int = 4, settle_every: int = 64,
                 settle_after: int = 2, smoothing: float = 0.3, margin: float = 0.05,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if cores < 2:
            raise ValueError(f"DecodeThreads needs at least 2 cores to choose between, got {cores}")
        self.wide, self.narrow = cores, cores - 1
        self.chosen = self.wide
        self.log_ratio = 0.0
        self.samples = 0
        self.switches = 0
        self.explore_every, self.settle_every, self.settle_after = explore_every, settle_every, settle_after
        self.smoothing, self.margin, self.clock = smoothing, margin, clock
        self._previous: tuple[int, Hashable, float] | None = None  # the last decoding step: threads, shape, seconds
        self._since_explore = 0

    @property
    def other(self) -> int:
        return self.narrow if self.chosen == self.wide else self.wide

    def use(self, decoding: bool, shape: Hashable) -> int:
        """Set torch's intra-op thread count for the next step and return it (``decoding``: no
        prompt tokens in the step; ``shape``: what a step must share with another to be compared
        with it, such as its batch size)."""
        threads = self._pick(decoding, shape)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        return threads

    def release(self) -> None:
        """Give torch back every core (the engine is idle: other torch code in the process runs
        on the count it expects)."""
        if torch.get_num_threads() != self.wide:
            torch.set_num_threads(self.wide)

    def _pick(self, decoding: bool, shape: Hashable) -> int:
        if not decoding:
            self._previous = None  # a prompt step between two decoding steps: no fair comparison
            return self.wide
        self._since_explore += 1
        period = self.explore_every if self.samples < self.settle_after else self.settle_every
        previous = self._previous
        if (self._since_explore >= period and previous is not None and previous[0] == self.chosen
                and previous[1] == shape):
            self._since_explore = 0
            return self.other
        return self.chosen

    def observe(self, threads: int, shape: Hashable, seconds: float) -> None:
        """A decoding step of ``shape`` on ``threads`` threads took ``seconds``."""
        previous = self._previous
        self._previous = (threads, shape, seconds)
        if threads == self.chosen or previous is None or previous[0] != self.chosen or previous[1] != shape:
            return
        sample = math.log(max(seconds, 1e-9) / max(previous[2], 1e-9))
        self.samples += 1
        self.log_ratio += max(self.smoothing, 1.0 / self.samples) * (sample - self.log_ratio)
        if self.samples >= self.settle_after and self.log_ratio < -self.margin:
            self.chosen, self.log_ratio = threads, -self.log_ratio
            self.switches += 1

    def summary(self) -> dict[str, float]:
        return {"decode_threads": self.chosen, "decode_threads_log_ratio": round(self.log_ratio, 3),
                "decode_threads_switches": self.switches}
