"""How the examples time their work, so that a printed ratio can be trusted.

Each side runs the same work on an engine of its own, its caches reset before every repeat (so
every repeat starts as cold as the first), repeated until a timed run lasts at least ``at_least``
seconds; the sides take turns for ``rounds`` rounds, and each side's figure is the median over
rounds of its seconds per repeat. On a shared machine, a second or more of work per run and taking
turns keep a side from being timed alone in a slow moment.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable

from mmkv import Engine


def alternate(sides: dict[str, tuple[Engine, Callable[[Engine], object]]], rounds: int = 3,
              at_least: float = 1.0) -> tuple[dict[str, float], int]:
    """Each side's median seconds per repeat of its work, and the repeats a run made."""
    first = {}
    for name, (engine, work) in sides.items():  # untimed: a warm-up that also sizes the runs
        engine.reset_prefix_cache()
        start = time.perf_counter()
        work(engine)
        first[name] = time.perf_counter() - start
    repeats = max(1, math.ceil(at_least / min(first.values())))
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    for round_ in range(rounds):
        order = list(sides) if round_ % 2 == 0 else list(reversed(sides))
        for name in order:
            engine, work = sides[name]
            total = 0.0
            for _ in range(repeats):
                engine.reset_prefix_cache()
                start = time.perf_counter()
                work(engine)
                total += time.perf_counter() - start
            seconds[name].append(total / repeats)
    return {name: statistics.median(values) for name, values in seconds.items()}, repeats
