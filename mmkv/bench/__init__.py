"""Benchmarks: ``python -m mmkv.bench <name> [--json]``; the last line of ``--json`` output is one
JSON object."""

from __future__ import annotations

import contextlib
import gc
import time
from typing import Callable, Iterator, TypeVar

T = TypeVar("T")


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """After a full garbage collection, with the collector paused, as ``timeit`` measures: a
    collection of everything the process has built so far is not charged to whichever run or
    step it falls in (``python -m mmkv.bench`` freezes what its imports built, so the collection
    here scans only what the runs built)."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    """``fn()`` and its wall time in seconds, the collector paused (``gc_paused``)."""
    with gc_paused():
        start = time.perf_counter()
        result = fn()
        return result, time.perf_counter() - start


def rotated(sides: list[str], repeats: int) -> list[list[str]]:
    """Each round's order: ``sides`` rotated by one more each round, so in every ``len(sides)``
    rounds each side takes each place in the order once (a slow stretch of the machine meets
    every side alike)."""
    return [sides[r % len(sides):] + sides[:r % len(sides)] for r in range(repeats)]
