"""Which sequence a full pool preempts (``mmkv.preemption``): each term of the cost ranking, the
priority rule, the restore estimate's treatment of shared blocks, the victim and the mode that
stated restore speeds choose, and the scheduler's use of the ranking, on a scheduler driven
without a model (the tokens' K/V are never computed)."""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import pytest
import torch

import mmkv.engine_core as engine_module
import mmkv.restore_speeds as restore_speeds
import mmkv.scheduler as scheduler_module

from cache import KVCache, KVLayout
from mmkv.preemption import CostWeights, RestoreSpeeds, preemption_cost, rank_victims, restore_estimate
from mmkv.sampling_params import SamplingParams
from mmkv.scheduler import Scheduler, SchedulerConfig
from mmkv.sequence import Sequence

BLOCK = 4
SPEEDS = RestoreSpeeds(flops=1e11, swap_latency=1e-4, swap_block_seconds=1e-4)
WEIGHTS = CostWeights(wait=0.1, progress=0.01, repeat=1.0)
_ids = itertools.count()


def sequence(prompt: int = 8, generated: int = 0, priority: int = 0, preemptions: int = 0,
             arrival_time: float = 0.0) -> Sequence:
    seq_id = next(_ids)
    params = SamplingParams(max_tokens=64, ignore_eos=True, priority=priority)
    tokens = [seq_id * 1000 + i for i in range(prompt + generated)]  # shares no block with another
    return Sequence(seq_id=seq_id, request_id=seq_id, index=0, token_ids=tokens,
                    prompt_len=prompt, params=params, arrival=seq_id, namespace=b"", generator=None,
                    arrival_time=arrival_time, preemptions=preemptions)


def first_victim(candidates: list[Sequence], restore: dict[int, float], now: float = 10.0,
                 weights: CostWeights = WEIGHTS, policy: str = "cost") -> Sequence:
    return rank_victims(candidates, policy, weights, lambda s: restore[s.seq_id], now)[0]


def test_a_long_fresh_prompt_outlives_a_short_one():
    """The long prompt arrived last (newest first would drop it) but costs far more to restore."""
    short, long = sequence(prompt=8), sequence(prompt=400)
    assert first_victim([short, long], {short.seq_id: 0.01, long.seq_id: 2.0}) is short
    assert first_victim([short, long], {short.seq_id: 0.01, long.seq_id: 2.0}, policy="newest") is long


def test_priority_dominates_the_cost():
    urgent, cheap_or_not = sequence(priority=0), sequence(priority=3)
    restore = {urgent.seq_id: 0.0, cheap_or_not.seq_id: 50.0}
    assert first_victim([urgent, cheap_or_not], restore) is cheap_or_not
    assert first_victim([urgent, cheap_or_not], restore, policy="newest") is cheap_or_not


def test_each_earlier_preemption_raises_the_cost():
    """Alike but for one earlier preemption: the other one goes first, though it is older."""
    fresh, again = sequence(arrival_time=5.0), sequence(arrival_time=5.0, preemptions=1)
    assert first_victim([fresh, again], {fresh.seq_id: 0.1, again.seq_id: 0.1}) is fresh
    assert (preemption_cost(again, 0.1, 10.0, WEIGHTS) - preemption_cost(fresh, 0.1, 10.0, WEIGHTS)
            == pytest.approx(WEIGHTS.repeat))


def test_waiting_longer_raises_the_cost():
    early, late = sequence(arrival_time=1.0), sequence(arrival_time=9.0)
    # the early one is cheaper to restore, but it has waited 9 s to the late one's 1
    assert first_victim([early, late], {early.seq_id: 0.3, late.seq_id: 0.5}) is late
    assert first_victim([early, late], {early.seq_id: 0.0, late.seq_id: 0.9}) is early


def test_progress_raises_the_cost():
    far, fresh = sequence(generated=200, arrival_time=5.0), sequence(arrival_time=5.0)
    # the one far along arrived last: newest first would drop it
    assert first_victim([fresh, far], {fresh.seq_id: 0.5, far.seq_id: 0.5}) is fresh
    assert preemption_cost(far, 0.5, 5.0, WEIGHTS) == pytest.approx(0.5 + 200 * WEIGHTS.progress)


def test_ties_go_to_the_newest_and_weights_must_not_be_negative():
    a, b = sequence(arrival_time=3.0), sequence(arrival_time=3.0)
    assert first_victim([a, b], {a.seq_id: 0.2, b.seq_id: 0.2}) is b
    with pytest.raises(ValueError, match="repeat must be >= 0"):
        CostWeights(repeat=-1.0)
    with pytest.raises(ValueError, match="preemption_policy must be one of"):
        SchedulerConfig(preemption_policy="oldest")


# -- the scheduler, without a model --------------------------------------------------------------

def make_scheduler(blocks: int, policy: str, host_blocks: int = 0, now=lambda: 0.0,
                   preemption: str = "recompute", speeds: RestoreSpeeds = SPEEDS) -> Scheduler:
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=BLOCK, dtype=torch.float32)
    kv = KVCache(layout, blocks, num_host_blocks=host_blocks)
    config = SchedulerConfig(max_num_batched_tokens=4096, preemption=preemption,
                             preemption_policy=policy, preemption_weights=WEIGHTS)
    return Scheduler(kv, config, lambda start, count: 1e9 * count, speeds, clock=now)


def run_step(scheduler: Scheduler) -> list[Sequence]:
    """Schedule a step and commit it as a model would (a decoding sequence gets one token)."""
    batch = scheduler.schedule()
    for seq, q in zip(batch.seqs, batch.q_lens):
        scheduler.commit(seq, q)
        if seq.num_computed == len(seq.token_ids):
            seq.token_ids.append(seq.token_ids[-1] + 1)
    return batch.seqs


def test_a_shared_prefix_costs_nothing_to_restore():
    """Two sequences on one forked table share every block: dropping either frees nothing to
    recompute, while a sequence of its own costs all its tokens."""
    scheduler = make_scheduler(64, "cost")
    own, parent = sequence(prompt=16), sequence(prompt=16)
    for seq in (own, parent):
        scheduler.add(seq)
    run_step(scheduler)
    child = sequence(prompt=16)
    child.table, child.num_computed = scheduler.kv.fork(parent.table), parent.num_computed
    scheduler.add_running(child)
    _, shared = restore_estimate(parent, scheduler.kv, "recompute", scheduler.rebuild_flops, SPEEDS)
    _, alone = restore_estimate(own, scheduler.kv, "recompute", scheduler.rebuild_flops, SPEEDS)
    assert shared == 0.0 and alone == pytest.approx(16 * 1e9 / 1e11)
    scheduler.finish(child)


def test_a_full_pool_preempts_the_cheapest_not_the_newest():
    """Three prompts fill a 16-block pool (16, 4 and 43 tokens, in that order); when the first
    needs a block to decode, ``cost`` drops the 4-token one (the least to recompute) and
    ``newest`` the 43-token one."""
    for policy, expected in (("cost", "short"), ("newest", "long")):
        scheduler = make_scheduler(16, policy)
        old, short, long = sequence(prompt=16), sequence(prompt=4), sequence(prompt=43)
        for seq in (old, short, long):
            scheduler.add(seq)
        assert run_step(scheduler) == [old, short, long] and scheduler.kv.num_available() == 0
        assert old in run_step(scheduler)
        victims = {name for name, seq in (("old", old), ("short", short), ("long", long))
                   if seq.preemptions}
        assert victims == {expected}, policy
        assert scheduler.stats()["max_preemptions_per_request"] == 1
        for seq in (old, short, long):
            scheduler.finish(seq)


def test_a_sequence_swapped_out_after_its_slot_was_reserved_comes_back_holding_only_its_tokens():
    """A decoding step reserves a slot for the first sequence, then the second needs a block the
    full pool does not have, and the first (one block against two: the cheaper) is swapped out.
    The slot reserved for it this step is given back first: swapped in later, its table holds
    exactly its computed tokens (a slot kept would be K/V never computed, read as the next
    token's)."""
    scheduler = make_scheduler(3, "cost", host_blocks=4, preemption="swap")
    first, second = sequence(prompt=3), sequence(prompt=8)
    for seq in (first, second):
        scheduler.add(seq)
    run_step(scheduler)  # both prefilled: 1 + 2 blocks, the pool full
    assert run_step(scheduler) == [second] and first.swapped is not None
    scheduler.check_integrity()
    assert first.swapped.num_tokens == first.num_computed == 3
    scheduler.finish(second)
    assert run_step(scheduler) == [first]  # swapped in, its pending token computed
    scheduler.check_integrity()
    assert first.table.num_tokens == first.num_computed == 4
    scheduler.finish(first)


# -- an engine under a steady stream -------------------------------------------------------------

def serve_stream(eng, stream: list[tuple[int, list[int], SamplingParams]]) -> list[list[int]]:
    """Each request added at its step; the outputs in arrival order."""
    from_step = sorted(stream, key=lambda item: item[0])
    ids, outputs, step = [], {}, 0
    while from_step or eng.has_unfinished():
        while from_step and from_step[0][0] <= step:
            _, prompt, params = from_step.pop(0)
            ids.append(eng.add_request(prompt, params))
        for out in eng.step():
            if out.finished:
                outputs[out.request_id] = out.token_ids
        step += 1
    return [outputs[i] for i in ids]


def test_a_steady_stream_preempts_no_request_without_bound_under_cost(model_dirs, hf_oracle,
                                                                       monkeypatch):
    """Short requests arrive every other step (4-token prompts, 24-token answers) and one with a
    48-token prompt arrives at step 20, on a 40-block pool: ``newest`` preempts one request five
    times, ``cost`` none more than twice; both give transformers' greedy outputs. (A clock that
    moves a millisecond a reading keeps the waiting term the same on every machine.)"""
    from test_engine_oracle import engine

    monkeypatch.setattr(engine_module, "measured_restore_speeds", lambda runner, kv: SPEEDS)
    rng = random.Random(0)
    stream = [(2 * i, [rng.randrange(256) for _ in range(4)], SamplingParams(max_tokens=24, ignore_eos=True))
              for i in range(40)]
    stream.append((20, [rng.randrange(256) for _ in range(48)], SamplingParams(max_tokens=8, ignore_eos=True)))
    most = {}
    for policy in ("newest", "cost"):
        ticks = itertools.count()
        monkeypatch.setattr(scheduler_module, "time", SimpleNamespace(monotonic=lambda: next(ticks) / 1000))
        eng = engine(model_dirs, blocks=40, preemption="recompute", preemption_policy=policy)
        outs = serve_stream(eng, stream)
        for (_, prompt, _), out in zip(sorted(stream, key=lambda item: item[0]), outs):
            hf_oracle.check("llama", prompt, out)
        most[policy] = eng.stats()["max_preemptions_per_request"]
    assert most["newest"] >= 5 and most["cost"] <= 2, most


# -- restore speeds: what they decide, and their measurement -------------------------------------

FAST_SWAP = RestoreSpeeds(flops=1e11, swap_latency=1e-3, swap_block_seconds=1e-2)
SLOW_SWAP = RestoreSpeeds(flops=1e11, swap_latency=1e-3, swap_block_seconds=5e-2)


def test_the_stated_speeds_decide_between_swapping_and_recomputing():
    """16 private tokens (4 blocks, 1.6e10 FLOPs) take 0.16 s to recompute at 1e11 FLOP/s, and
    1 ms + 4 x 10 ms = 0.041 s or 1 ms + 4 x 50 ms = 0.201 s to swap out and back: ``auto`` takes
    the cheaper; ``recompute`` and ``swap`` take theirs whatever the speeds."""
    scheduler = make_scheduler(16, "cost", host_blocks=8, preemption="auto")
    seq = sequence(prompt=16)
    scheduler.add(seq)
    run_step(scheduler)
    kv, flops = scheduler.kv, scheduler.rebuild_flops
    assert restore_estimate(seq, kv, "auto", flops, FAST_SWAP) == ("swap", pytest.approx(0.041))
    assert restore_estimate(seq, kv, "auto", flops, SLOW_SWAP) == ("recompute", pytest.approx(0.16))
    assert restore_estimate(seq, kv, "recompute", flops, FAST_SWAP).how == "recompute"
    assert restore_estimate(seq, kv, "swap", flops, SLOW_SWAP) == ("swap", pytest.approx(0.201))
    scheduler.finish(seq)


@pytest.mark.parametrize("speeds, swapped", [(FAST_SWAP, True), (SLOW_SWAP, False)])
def test_the_scheduler_preempts_the_way_its_speeds_price_cheaper(speeds, swapped):
    """A full 3-block pool: the first sequence (1 block: 4 tokens, 0.04 s to recompute) gives way
    and is swapped out (1 ms + 10 ms) or dropped to recompute (against 1 ms + 50 ms)."""
    scheduler = make_scheduler(3, "cost", host_blocks=4, preemption="auto", speeds=speeds)
    first, second = sequence(prompt=3), sequence(prompt=8)
    for seq in (first, second):
        scheduler.add(seq)
    run_step(scheduler)
    assert run_step(scheduler) == [second] and first.preemptions == 1
    stats = scheduler.stats()
    assert (stats["preemptions_swap"], stats["preemptions_recompute"]) == ((1, 0) if swapped else (0, 1))
    for seq in (first, second):
        scheduler.finish(seq)


def test_a_slower_machine_gives_recomputation_more_weight_than_a_repeat():
    """A fresh sequence of 16 private tokens against one of 4 tokens preempted once before
    (``repeat`` 1 s). At 1e11 FLOP/s the fresh one costs 0.16 s and the other 1.04 s: the fresh
    one goes. At 1e10 FLOP/s the fresh one costs 1.6 s and the other 1.4 s: the other goes."""
    scheduler = make_scheduler(16, "cost")
    fresh = sequence(prompt=16, arrival_time=10.0)
    again = sequence(prompt=4, preemptions=1, arrival_time=10.0)
    for seq in (fresh, again):
        scheduler.add(seq)
    run_step(scheduler)
    for flops, victim in ((1e11, fresh), (1e10, again)):
        speeds = RestoreSpeeds(flops=flops, swap_latency=1e-4, swap_block_seconds=1e-4)
        def restore(s: Sequence) -> float:
            return restore_estimate(s, scheduler.kv, "recompute", scheduler.rebuild_flops, speeds).seconds

        assert rank_victims([fresh, again], "cost", WEIGHTS, restore, 10.0)[0] is victim, flops
    for seq in (fresh, again):
        scheduler.finish(seq)


def test_speeds_are_measured_once_per_kind_of_engine_and_leave_the_cache_as_found(model_dirs,
                                                                                   monkeypatch):
    """A second engine of the same kind reuses the first's speeds; an engine without a host tier
    is another kind, and prices no swap. The measurement's blocks and host slots are free again."""
    from test_engine_oracle import engine

    measure, kinds = restore_speeds._measure, []
    monkeypatch.setattr(restore_speeds, "MEASURED", {})
    monkeypatch.setattr(restore_speeds, "_measure",
                        lambda runner, kv, tokens: kinds.append(tokens) or measure(runner, kv, tokens))
    first, second = engine(model_dirs, blocks=64), engine(model_dirs, blocks=64)
    assert len(kinds) == 1 and first.scheduler.speeds is second.scheduler.speeds
    assert first.kv.pool.num_free == 64 and first.kv.host_pool.num_free == 64
    no_host = engine(model_dirs, blocks=64, host_kv_memory=0)
    assert len(kinds) == 2 and no_host.scheduler.speeds.swap_block_seconds == float("inf")
    assert no_host.kv.pool.num_free == 64
    with pytest.raises(ValueError, match="flops must be > 0"):
        RestoreSpeeds(flops=0.0, swap_latency=0.0, swap_block_seconds=1.0)
