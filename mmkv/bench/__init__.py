"""Benchmarks: ``python -m mmkv.bench <name> [--json]``; the last line of ``--json`` output is one
JSON object."""

from __future__ import annotations

import argparse
import contextlib
import gc
import time
from typing import Callable, ContextManager, Iterator, TypeVar

T = TypeVar("T")


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """After a full garbage collection, with the collector paused, as ``timeit`` measures: a
    collection of everything the process has built so far is not charged to whichever run or
    step it falls in (``python -m mmkv.bench`` freezes what existed before the benchmark ran, so
    the collection here scans only what the runs built)."""
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


def add_bundled_answer_arguments(p: argparse.ArgumentParser) -> None:
    """The options of a benchmark that times the bundled model answering report questions at
    batch 1 and 32 (``serve_bundled``)."""
    p.add_argument("--requests", type=int, default=32, help="served together (batch 32)")
    p.add_argument("--batch1-requests", type=int, default=8, help="served one at a time")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)


def serve_bundled(prompts: list[str], batch: int, params: list, during: Callable[[], ContextManager]
                  = contextlib.nullcontext) -> tuple[list, float]:
    """Outputs and seconds of ``prompts`` (each with its ``params``) served ``batch`` at a time on
    a fresh bundled engine, warmed up on a prompt the run never serves; the timed part runs
    inside ``during()`` with the collector paused."""
    from mmkv import Engine
    from mmkv.bundled import BUNDLED_MODEL

    engine = Engine(BUNDLED_MODEL, kv_cache_memory="256MiB", host_kv_memory="16MiB")
    engine.generate(["warm up on a prompt the run never serves"], params[0])
    outs = []
    with during(), gc_paused():
        start = time.perf_counter()
        for i in range(0, len(prompts), batch):
            outs += [o.outputs[0] for o in engine.generate(prompts[i:i + batch], params[i:i + batch])]
        return outs, time.perf_counter() - start
