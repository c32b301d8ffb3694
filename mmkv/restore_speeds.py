"""This machine's speeds for pricing a preempted sequence's restore (``mmkv.preemption``).

``measured_restore_speeds`` times, once per process for each kind of engine (device, dtype, model
size, attention backend, block size, whether there is a host tier):

* a prefill of up to ``PREFILL_TOKENS`` made-up tokens through the engine's own runner, as the
  FLOP/s of the model's ``text_rebuild_flops`` (the per-step overhead is spread over the tokens);
* a round trip (device -> host tier -> device) of 1 and of up to ``SWAP_BLOCKS`` blocks of the
  real block size, fitted as a fixed latency plus seconds per block.

Each figure takes the fastest of its timings (``PREFILL_REPEATS`` and ``SWAP_REPEATS``, after one
untimed run that pays whatever a first call pays), the least disturbed by other work. The
measurement leaves the cache as it found it: its blocks are freed, nothing enters the radix tree,
and the host slots it used are free again. A decision made from these speeds is tested with
speeds a test states (``mmkv.preemption.RestoreSpeeds``), never with a live measurement.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Callable

import torch

from cache import BlockTable
from mmkv.preemption import RestoreSpeeds
from mmkv.sampling_params import SamplingParams
from mmkv.scheduler import ScheduledBatch
from mmkv.sequence import Sequence

if TYPE_CHECKING:
    from cache import KVCache
    from mmkv.runner import ModelRunner

PREFILL_TOKENS = 64  # the timed prefill's length (fewer when the pool holds fewer)
SWAP_BLOCKS = 8  # the longer timed round trip's blocks (fewer when the pool or host tier holds fewer)
PREFILL_REPEATS = 3  # timed prefills; the fastest counts
SWAP_REPEATS = 10  # timed round trips of each length; the fastest counts


MEASURED: dict[tuple, RestoreSpeeds] = {}  # this process's measurements, by kind of engine


def measured_restore_speeds(runner: ModelRunner, kv: KVCache) -> RestoreSpeeds:
    """The speeds of ``runner``'s model over ``kv`` on this machine, measured on the first call
    for this kind of engine in the process (the pool must be empty then)."""
    model = runner.model
    tokens = max(1, min(PREFILL_TOKENS, kv.num_available() * kv.block_size, model.max_model_len))
    key = (str(model.device), str(model.dtype), model.text_rebuild_flops(0, tokens),
           type(runner.attention).__name__, kv.bytes_per_block, kv.host_pool is not None)
    if key not in MEASURED:
        MEASURED[key] = _measure(runner, kv, tokens)
    return MEASURED[key]


def _measure(runner: ModelRunner, kv: KVCache, tokens: int) -> RestoreSpeeds:
    table = BlockTable()
    kv.append_slots(table, tokens)
    try:
        prefill = _fastest(lambda: _prefill_seconds(runner, table, tokens), PREFILL_REPEATS)
        flops = runner.model.text_rebuild_flops(0, tokens) / prefill
        if kv.host_pool is None:
            return RestoreSpeeds(flops, 0.0, math.inf)
        latency, per_block = _swap_speeds(kv, table.blocks)
        return RestoreSpeeds(flops, latency, per_block)
    finally:
        kv.free(table)


def _fastest(timed: Callable[[], float], repeats: int) -> float:
    """The least of ``repeats`` timings, after one untimed run."""
    timed()
    return min(timed() for _ in range(repeats))


def _prefill_seconds(runner: ModelRunner, table: BlockTable, tokens: int) -> float:
    """One pass computing ``tokens`` made-up tokens into ``table``'s slots (no image token)."""
    image_token = runner.model.image_token_id
    ids = [t for t in range(1, tokens + 2) if t != image_token][:tokens]
    seq = Sequence(seq_id=-1, request_id=-1, index=0, token_ids=ids, prompt_len=tokens,
                   params=SamplingParams(max_tokens=1), arrival=-1, namespace=b"", generator=None,
                   table=table, rope=runner.model.prompt_positions(ids, []))
    start = time.perf_counter()
    runner.run(ScheduledBatch([seq], [tokens], [], [], []))
    _synchronize(runner.model.device)
    return time.perf_counter() - start


def _swap_speeds(kv: KVCache, blocks: list[int]) -> tuple[float, float]:
    """(latency, seconds per block) of a round trip through the host tier, from timing 1 block
    and ``n`` blocks; with one block to time, all of it is per block. The per-block share is at
    least a tenth of the longer trip's mean, so that timing noise cannot make swapping free."""
    n = min(SWAP_BLOCKS, len(blocks), kv.host_pool.num_free)
    one = _fastest(lambda: _round_trip_seconds(kv, blocks[:1]), SWAP_REPEATS)
    if n < 2:
        return 0.0, one
    many = _fastest(lambda: _round_trip_seconds(kv, blocks[:n]), SWAP_REPEATS)
    per_block = max((many - one) / (n - 1), many / n / 10)
    return max(0.0, one - per_block), per_block


def _round_trip_seconds(kv: KVCache, blocks: list[int]) -> float:
    slots = kv.host_pool.allocate(len(blocks))
    try:
        start = time.perf_counter()
        kv.storage.swap_out(blocks, slots)
        kv.storage.swap_in(slots, blocks)
        _synchronize(kv.storage.device)
        return time.perf_counter() - start
    finally:
        kv.host_pool.decref(slots)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
