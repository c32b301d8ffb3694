import pytest
import torch

from cache import KVCache, KVLayout, OutOfBlocksError, kv_format, make_keys, parse_bytes

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4)


@pytest.fixture(params=[torch.float32, torch.int8, torch.float8_e4m3fn], ids=["fp32", "int8", "fp8"])
def layout(request) -> KVLayout:
    """``LAYOUT`` with its second layer in each storage format (the first in float32: mixed
    precision per layer), for the tests of what moves blocks: every byte of a compressed
    block, its rows' scales included, must move with it."""
    return KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4,
                    layer_dtypes=(torch.float32, request.param))


def _as_bytes(rows: torch.Tensor) -> torch.Tensor:
    """Rows ``[2, n, heads, width]`` of any storage dtype as their bytes ``[2, n, heads, bytes]``."""
    return rows.contiguous().view(torch.uint8)


def write(cache: KVCache, slots: list[int], seed: int) -> torch.Tensor:
    """Write random K/V, encoded in each layer's format, into flat slots of every layer of the
    target store; returns the bytes written, ``[2, len(slots), heads, bytes of every layer]``."""
    lay = cache.layout
    g = torch.Generator().manual_seed(seed)
    data = torch.randn(lay.num_layers, 2, len(slots), lay.num_kv_heads, lay.head_dim, generator=g)
    bs = lay.block_size
    written = []
    for layer, values in zip(cache.storage.stores[0], data):
        rows = kv_format.encode(values, layer.dtype)
        for i, s in enumerate(slots):
            layer[s // bs, :, s % bs] = rows[:, i]
        written.append(_as_bytes(rows))
    return torch.cat(written, -1)


def read(cache: KVCache, table) -> torch.Tensor:
    """The bytes a table's tokens hold, laid out as ``write`` returns them."""
    bs = cache.layout.block_size
    slots = [table.blocks[t // bs] * bs + t % bs for t in range(table.num_tokens)]
    return torch.cat([_as_bytes(torch.stack([layer[s // bs, :, s % bs] for s in slots], dim=1))
                      for layer in cache.storage.stores[0]], -1)


def filled_table(cache: KVCache, n: int, seed: int):
    from cache import BlockTable
    table = BlockTable()
    data = write(cache, cache.append_slots(table, n), seed)
    return table, data


def test_sizes_from_a_byte_budget():
    assert LAYOUT.bytes_per_block == 2 * 2 * 4 * 2 * 4 * 4 == 512
    cache = KVCache.from_memory(LAYOUT, "4KiB", host_memory="1KiB")
    assert cache.pool.num_blocks == 8 and cache.host_pool.num_blocks == 2
    assert cache.storage.layers[0].shape == (8, 2, 4, 2, 4)
    assert parse_bytes("2GiB") == 2 << 30 and parse_bytes("1.5MB") == 1_500_000
    for bad in ("lots", "-1GiB", "3 parsecs", 0):
        with pytest.raises(ValueError, match="memory size"):
            parse_bytes(bad)
    with pytest.raises(ValueError, match="holds no block"):
        KVCache.from_memory(LAYOUT, "100B")


def test_fork_shares_blocks_and_copies_on_first_write(layout):
    cache = KVCache(layout, num_blocks=8)
    parent, data = filled_table(cache, 6, seed=0)  # one full and one partial block
    child = cache.fork(parent)
    assert child.blocks == parent.blocks and cache.pool.refcount[parent.blocks[1]] == 2
    [slot] = cache.append_slots(child, 1)
    assert child.blocks[0] == parent.blocks[0] and child.blocks[1] != parent.blocks[1]
    assert cache.metrics.cow_copies == 1
    write(cache, [slot], seed=1)
    assert torch.equal(read(cache, parent), data)  # the parent's partial block is untouched
    assert torch.equal(read(cache, child)[:, :6], data)
    [slot2] = cache.append_slots(parent, 1)  # the parent now owns its block alone: no copy
    assert slot2 // layout.block_size == parent.blocks[1] and cache.metrics.cow_copies == 1
    cache.free(parent)
    cache.free(child)
    assert cache.pool.num_free == 8


def test_cached_partial_prefix_is_copied_token_exactly(layout):
    cache = KVCache(layout, num_blocks=8)
    tokens = list(range(12))
    table, data = filled_table(cache, 12, seed=3)
    cache.cache_prefix(table, make_keys(tokens))
    cache.free(table)
    hit = cache.acquire_prefix(make_keys(tokens[:10]))
    assert hit.num_tokens == 10 and len(hit.blocks) == 3
    assert not cache.pool.cached[hit.blocks[2]]  # a private copy of the matching slots
    assert torch.equal(read(cache, hit), data[:, :10])
    write(cache, cache.append_slots(hit, 2), seed=4)  # writes go to the private block only
    again = cache.acquire_prefix(make_keys(tokens))
    assert torch.equal(read(cache, again), data)
    cache.free(hit)
    cache.free(again)


def test_append_is_all_or_nothing():
    cache = KVCache(LAYOUT, num_blocks=2)
    table, _ = filled_table(cache, 6, seed=0)
    with pytest.raises(OutOfBlocksError, match="need 1 blocks, 0 available"):
        cache.append_slots(table, 3)
    assert table.num_tokens == 6 and len(table.blocks) == 2
    cache.free(table)


def test_swap_round_trip_is_bit_exact(layout):
    cache = KVCache(layout, num_blocks=6, num_host_blocks=4)
    table, data = filled_table(cache, 10, seed=5)
    swapped = cache.swap_out(table)
    assert cache.pool.num_free == 6 and cache.metrics.swapped_out_blocks == 3
    filler, _ = filled_table(cache, 12, seed=6)  # device blocks get reused meanwhile
    cache.free(filler)
    back = cache.swap_in(swapped)
    assert torch.equal(read(cache, back), data)
    assert cache.host_pool.num_free == 4 and cache.metrics.swapped_in_blocks == 3
    cache.free(back)


def test_swap_keeps_shared_blocks_on_device(layout):
    cache = KVCache(layout, num_blocks=6, num_host_blocks=4)
    table, data = filled_table(cache, 10, seed=7)
    sibling = cache.fork(table)  # shares all three blocks
    cache.append_slots(sibling, 1)  # copy-on-write: the partial last block is now private
    swapped = cache.swap_out(table)
    assert swapped.blocks[:2] == sibling.blocks[:2] and swapped.blocks[2] == -1
    assert len(swapped.host_slots) == 1
    back = cache.swap_in(swapped)
    assert back.blocks[:2] == sibling.blocks[:2] and torch.equal(read(cache, back), data)
    parked = cache.swap_out(back)
    cache.drop_swapped(parked)
    cache.free(sibling)
    assert cache.pool.num_free == 6 and cache.host_pool.num_free == 4


def test_swap_without_host_tier_says_so():
    cache = KVCache(LAYOUT, num_blocks=2)
    table, _ = filled_table(cache, 2, seed=0)
    with pytest.raises(OutOfBlocksError, match="no host tier"):
        cache.swap_out(table)
    cache.free(table)


def test_compaction_moves_live_blocks_down_and_keeps_data(layout):
    cache = KVCache(layout, num_blocks=12)
    tables = [filled_table(cache, 8, seed=i) for i in range(5)]  # blocks 0..9
    cached_tokens = list(range(100, 108))
    cache.cache_prefix(tables[4][0], make_keys(cached_tokens))
    for t, _ in tables[:3]:
        cache.free(t)  # holes at 0..5; blocks 6..9 stay (one table live, one cached)
    mapping = cache.compact()
    assert sorted(mapping.values()) == [0, 1, 2, 3] and sorted(mapping) == [6, 7, 8, 9]
    tail = cache.pool.allocate(8)
    assert tail == list(range(4, 12))  # a contiguous free tail
    cache.pool.decref(tail)
    for t, data in tables[3:]:
        t.remap(mapping)
        assert max(t.blocks) < 4 and torch.equal(read(cache, t), data)
        cache.free(t)
    assert cache.pool.num_evictable == 2 and cache.metrics.compactions == 1
    hit = cache.acquire_prefix(make_keys(cached_tokens + [0]))
    assert hit.num_tokens == 8 and max(hit.blocks) < 4
    assert torch.equal(read(cache, hit), tables[4][1])
    cache.free(hit)


def test_resize_keeps_live_data_and_the_cached_prefixes_that_fit(layout):
    cache = KVCache(layout, num_blocks=12, num_host_blocks=4)
    tables = [filled_table(cache, 8, seed=i) for i in range(5)]  # blocks 0..9
    prefixes = {i: list(range(100 * i, 100 * i + 8)) for i in (1, 3)}
    for i, tokens in prefixes.items():
        cache.cache_prefix(tables[i][0], make_keys(tokens))
    for i in (0, 1, 2, 3):
        cache.free(tables[i][0])  # 1 and 3 stay cached (evictable); 4 stays in use
    cache.tree.match_prefix(make_keys(prefixes[3]))  # 3 is the more recently used
    mapping = cache.resize(5)  # room for the live table, one cached prefix and one more block
    assert cache.pool.num_blocks == 5 and cache.storage.layers[0].shape[0] == 5
    live, data = tables[4]
    live.remap(mapping)
    assert max(live.blocks) < 5 and torch.equal(read(cache, live), data)
    assert cache.metrics.evictions == 1 and cache.tree.num_cached_blocks == 3  # 1 lost its tail
    live.remap(cache.resize(4))
    assert cache.metrics.evictions == 2 and torch.equal(read(cache, live), data)
    assert cache.tree.match_prefix(make_keys(prefixes[1])).num_tokens == 0  # LRU: 1 went
    hit = cache.acquire_prefix(make_keys(prefixes[3] + [0]))
    assert hit.num_tokens == 8 and torch.equal(read(cache, hit), tables[3][1])
    cache.free(hit)
    cache.check_integrity()
    cache.resize(16)  # and back up: new blocks are free, old data stays
    assert cache.pool.num_free == 16 - 4 and torch.equal(read(cache, live), data)
    assert len(cache.append_slots(live, 40)) == 40  # the grown tail is usable
    cache.check_integrity()


def test_resize_below_the_blocks_in_use_changes_nothing(layout):
    cache = KVCache(layout, num_blocks=8)
    table, data = filled_table(cache, 12, seed=1)  # 3 blocks
    with pytest.raises(ValueError, match="3 are in use"):
        cache.resize(2)
    assert cache.pool.num_blocks == 8 and torch.equal(read(cache, table), data)
    cache.check_integrity()


def test_draft_slots_count_only_what_the_extra_store_holds_for_the_current_tokens():
    """``draft_slots``: 0 for a fresh block, grown by marks only where contiguous with what the
    block holds, at most the copied slots through a copy, and moved with a compaction."""
    cache = KVCache(LAYOUT, num_blocks=12)
    bs = LAYOUT.block_size
    table, _ = filled_table(cache, 10, seed=0)  # blocks a, b full; c holds 2 slots
    assert cache.draft_written_prefix(table, 10) == 0
    cache.mark_draft_written(table, 0, 6)
    assert cache.draft_written_prefix(table, 10) == 6
    cache.mark_draft_written(table, 9, 10)  # block c holds nothing: slot 1 alone is no prefix
    assert cache.draft_slots[table.blocks[2]] == 0 and cache.draft_written_prefix(table, 10) == 6
    cache.mark_draft_written(table, 6, 10)
    assert cache.draft_written_prefix(table, 10) == 10 and cache.draft_written_prefix(table, 7) == 7
    child = cache.fork(table)
    cache.append_slots(child, 1)  # copy-on-write of the partial block: its 2 slots come along
    assert cache.draft_slots[child.blocks[2]] == 2 and cache.draft_written_prefix(child, 11) == 10
    cache.free(child)
    cache.mark_draft_written(table, 10, 12)
    cache.append_slots(table, 2)  # three full blocks, every slot held
    cache.cache_prefix(table, make_keys(list(range(12))))
    hit = cache.acquire_prefix(make_keys(list(range(10))))  # a private copy of 2 of block c's 4 slots
    assert cache.draft_slots[hit.blocks[2]] == 2 and cache.draft_written_prefix(hit, 10) == 10
    cache.free(hit)
    cache.free(table)
    cache.tree.evict(3)  # the freed blocks come back fresh: nothing held
    again = cache.allocate(12)
    assert not cache.draft_slots[again].any()
    cache.pool.decref(again)
    cache = KVCache(LAYOUT, num_blocks=12)
    tables = [filled_table(cache, 8, seed=i)[0] for i in range(3)]  # blocks 0..5 in order
    cache.mark_draft_written(tables[2], 0, 7)
    cache.free(tables[0])
    mapping = cache.compact()
    assert sorted(mapping) == tables[2].blocks  # table 2 moves down into table 0's blocks
    for t in tables[1:]:
        t.remap(mapping)
    cache.resize(6)
    assert cache.draft_slots.shape == (6,) and cache.draft_written_prefix(tables[2], 8) == 7
    assert cache.draft_slots[tables[2].blocks[1]] == bs - 1 and cache.draft_written_prefix(tables[1], 8) == 0
    cache.check_integrity()
    for t in tables[1:]:
        cache.free(t)


def test_a_copy_on_write_copies_of_the_extra_store_only_the_slots_it_holds():
    """A partial block copied on write: the target's 2 slots come along, and of the extra store
    (a draft model's) only the 1 slot ``draft_slots`` says it holds; a block the draft never
    wrote copies nothing of it."""
    draft = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4)
    cache = KVCache(LAYOUT, num_blocks=12, extra_layouts=[draft])
    [store] = cache.storage.stores[1]
    store.copy_(torch.randn(store.shape, generator=torch.Generator().manual_seed(3)))
    marked, _ = filled_table(cache, 10, seed=0)  # blocks a, b full; c holds 2 slots
    unmarked, _ = filled_table(cache, 10, seed=1)
    cache.mark_draft_written(marked, 0, 9)  # block c: 1 of its 2 slots
    for table, held in ((marked, 1), (unmarked, 0)):
        child = cache.fork(table)
        cache.append_slots(child, 1)
        src, dst = table.blocks[2], child.blocks[2]
        assert torch.equal(cache.storage.layers[0][dst, :, :2], cache.storage.layers[0][src, :, :2])
        assert cache.draft_slots[dst] == held
        assert torch.equal(store[dst, :, :held], store[src, :, :held])
        assert not torch.equal(store[dst, :, held:2], store[src, :, held:2])  # not copied
        cache.free(child)
        cache.free(table)
    cache.check_integrity()
