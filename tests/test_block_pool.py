import pytest

from cache import BlockPool, OutOfBlocksError


def test_allocate_and_free_counts():
    pool = BlockPool(8)
    blocks = pool.allocate(3)
    assert sorted(blocks) == [0, 1, 2]  # low ids first
    assert (pool.num_free, pool.num_evictable, pool.num_in_use) == (5, 0, 3)
    pool.incref(blocks[:1])
    pool.decref(blocks)
    assert (pool.num_free, pool.num_in_use) == (7, 1)
    pool.decref(blocks[:1])
    assert pool.num_free == 8


def test_allocation_beyond_free_raises_and_changes_nothing():
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(OutOfBlocksError, match="requested 2 blocks, only 1 free"):
        pool.allocate(2)
    assert pool.num_free == 1


def test_cached_block_becomes_evictable_then_free():
    pool = BlockPool(4)
    [b] = pool.allocate(1)
    pool.mark_cached(b)
    pool.decref([b])
    assert (pool.num_free, pool.num_evictable, pool.num_in_use) == (3, 1, 0)
    pool.incref([b])  # a prefix hit revives it
    assert (pool.num_evictable, pool.num_in_use) == (0, 1)
    pool.decref([b])
    pool.uncache(b)
    assert pool.num_free == 4


@pytest.mark.parametrize("bad", ["incref_free", "decref_free", "cache_free", "zero"])
def test_misuse_is_rejected(bad):
    pool = BlockPool(2)
    with pytest.raises(ValueError):
        {"incref_free": lambda: pool.incref([0]), "decref_free": lambda: pool.decref([0]),
         "cache_free": lambda: pool.mark_cached(0), "zero": lambda: BlockPool(0)}[bad]()


def test_integrity_check_catches_a_lost_block():
    pool = BlockPool(3)
    lost = pool._free.pop()  # a block vanishes from every state
    with pytest.raises(AssertionError, match="free 2 \\+ evictable 0 \\+ in use 0 != 3"):
        pool.check_integrity()
    pool._free.append(lost)
