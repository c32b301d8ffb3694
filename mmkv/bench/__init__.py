"""Benchmarks: ``python -m mmkv.bench <name> [--json]``; the last line of ``--json`` output is one
JSON object."""

from __future__ import annotations

import gc
import time
from typing import Callable, TypeVar

T = TypeVar("T")


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    """``fn()`` and its wall time in seconds, measured as ``timeit`` does: after a full garbage
    collection and with the collector paused, so that a collection of everything the process has
    built so far (about 0.2 s with transformers loaded) is not charged to whichever run it falls in."""
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        result = fn()
        return result, time.perf_counter() - start
    finally:
        gc.enable()
