import numpy as np
import pytest

import cache.radix_tree as radix_tree
from cache import BlockPool, ImageSpan, RadixTree, make_keys

BS = 4


def cache_sequence(tree: RadixTree, tokens, namespace=b"", images=(), cost=None) -> list[int]:
    """Allocate blocks for the full blocks of ``tokens``, insert them, release the caller's refs."""
    keys = make_keys(tokens, images)
    blocks = tree.pool.allocate(len(tokens) // BS)
    result = tree.insert(keys, blocks, namespace, cost_per_block=cost)
    tree.unlock(result.blocks)
    return result.blocks


def test_match_returns_longest_full_block_prefix_and_partial_block():
    tree = RadixTree(BlockPool(32), BS)
    blocks = cache_sequence(tree, list(range(12)))
    m = tree.match_prefix(make_keys([0, 1, 2, 3, 4, 5, 9, 9, 9]))
    assert m.blocks == blocks[:1] and m.num_tokens == 4
    assert (m.partial_block, m.partial_tokens) == (blocks[1], 2)
    m = tree.match_prefix(make_keys(list(range(10))))  # query ends inside the third block
    assert m.blocks == blocks[:2] and (m.partial_block, m.partial_tokens) == (blocks[2], 2)
    assert tree.metrics.hits == 2 and tree.metrics.hit_tokens == 6 + 10


def test_insert_reports_existing_blocks_and_releases_duplicates():
    pool = BlockPool(32)
    tree = RadixTree(pool, BS)
    first = cache_sequence(tree, list(range(12)))
    mine = pool.allocate(4)
    result = tree.insert(make_keys(list(range(8)) + [7, 7, 7, 7, 1, 1, 1, 1]), mine)
    assert result.num_existing == 2
    assert result.blocks[:2] == first[:2] and result.blocks[2:] == mine[2:]
    assert pool.refcount[mine[0]] == 0 and not pool.cached[mine[0]]  # duplicate went back to free
    tree.unlock(result.blocks)
    assert tree.num_cached_blocks == 5


def test_match_splits_an_edge():
    tree = RadixTree(BlockPool(32), BS)
    cache_sequence(tree, list(range(16)))
    tree.match_prefix(make_keys(list(range(8))))
    root = tree._roots[b""]
    [upper] = root.child_nodes()
    [lower] = upper.child_nodes()
    assert (len(upper.blocks), len(lower.blocks)) == (2, 2)


def test_forced_hash_collision_never_gives_a_wrong_match(monkeypatch):
    monkeypatch.setattr(radix_tree, "chain_hash", lambda parent, key: 7)
    tree = RadixTree(BlockPool(64), BS)
    a = cache_sequence(tree, [1] * 12)
    b = cache_sequence(tree, [2] * 12)
    c = cache_sequence(tree, [1] * 4 + [3] * 8)
    assert tree.match_prefix(make_keys([2] * 12)).blocks == b
    assert tree.match_prefix(make_keys([1] * 12)).blocks == a
    assert tree.match_prefix(make_keys([1] * 4 + [3] * 8)).blocks == c
    assert c[0] == a[0] and not set(a) & set(b)
    assert tree.match_prefix(make_keys([4] * 8)).blocks == []


def test_namespaces_never_share():
    tree = RadixTree(BlockPool(32), BS)
    cache_sequence(tree, list(range(8)), namespace=b"tenant-a")
    assert tree.match_prefix(make_keys(list(range(8))), b"tenant-b").num_tokens == 0
    assert tree.match_prefix(make_keys(list(range(8))), b"").num_tokens == 0
    assert tree.match_prefix(make_keys(list(range(8))), b"tenant-a").num_tokens == 8


def test_images_share_only_when_identity_and_offset_match():
    tree = RadixTree(BlockPool(32), BS)
    placeholder = [5] * 8  # the same placeholder ids for every image
    cache_sequence(tree, placeholder, images=[ImageSpan(0, 8, image_id=1)])
    assert tree.match_prefix(make_keys(placeholder, [ImageSpan(0, 8, 1)])).num_tokens == 8
    assert tree.match_prefix(make_keys(placeholder, [ImageSpan(0, 8, 2)])).num_tokens == 0
    shifted = tree.match_prefix(make_keys([5] * 9, [ImageSpan(1, 8, 1)]))
    assert shifted.num_tokens == 0 and shifted.partial_tokens == 0
    assert tree.match_prefix(make_keys(placeholder)).num_tokens == 0  # plain text never hits an image


def test_locked_blocks_are_never_evicted():
    pool = BlockPool(16)
    tree = RadixTree(pool, BS)
    kept = cache_sequence(tree, list(range(8)))
    cache_sequence(tree, [9] * 8)
    tree.lock(tree.match_prefix(make_keys(list(range(8)))).blocks)
    assert tree.evict(100) == 2
    assert tree.match_prefix(make_keys(list(range(8)))).blocks == kept
    tree.unlock(kept)
    assert tree.evict(100) == 2 and pool.num_free == 16


def test_eviction_takes_leaf_tails_first():
    pool = BlockPool(16)
    tree = RadixTree(pool, BS)
    cache_sequence(tree, list(range(16)))
    assert tree.evict(1) == 1
    assert tree.match_prefix(make_keys(list(range(16)))).num_tokens == 12


@pytest.mark.parametrize("policy, survivor", [("lru", "old"), ("fifo", "new")])
def test_lru_and_fifo_order(policy, survivor):
    tree = RadixTree(BlockPool(16), BS, policy=policy)
    seqs = {"old": [1] * 8, "new": [2] * 8}
    cache_sequence(tree, seqs["old"])
    cache_sequence(tree, seqs["new"])
    tree.match_prefix(make_keys(seqs["old"]))  # recently used, but inserted first
    tree.evict(2)
    assert tree.match_prefix(make_keys(seqs[survivor])).num_tokens == 8
    other = "new" if survivor == "old" else "old"
    assert tree.match_prefix(make_keys(seqs[other])).num_tokens == 0


def cached(tree: RadixTree, tokens) -> bool:
    return tree.match_prefix(make_keys(tokens)).num_tokens == len(tokens)


def test_cost_policy_evicts_the_cheaper_of_two_unused_prefixes_first():
    """Cost: the expensive prefix is older (LRU and FIFO would evict it) but costlier to rebuild."""
    tree = RadixTree(BlockPool(32), BS, policy="cost")
    cache_sequence(tree, [1] * 8, cost=100.0)
    cache_sequence(tree, [2] * 8, cost=1.0)
    assert tree.evict(2) == 2
    assert cached(tree, [1] * 8) and not cached(tree, [2] * 8)


def test_cost_policy_keeps_the_more_often_hit_of_two_equal_prefixes():
    """Frequency: the prefix hit three times outlives one hit more recently but once."""
    tree = RadixTree(BlockPool(32), BS, policy="cost")
    cache_sequence(tree, [1] * 8, cost=1.0)
    cache_sequence(tree, [2] * 8, cost=1.0)
    for _ in range(3):
        tree.match_prefix(make_keys([1] * 8))
    tree.match_prefix(make_keys([2] * 8))
    assert tree.evict(2) == 2
    assert cached(tree, [1] * 8) and not cached(tree, [2] * 8)


def test_cost_policy_ages_an_unused_expensive_prefix_below_new_cheap_ones():
    """Inflation: each eviction raises the floor new credits start from, so an expensive prefix
    nobody uses is eventually evicted before a cheap one inserted after evictions happened."""
    tree = RadixTree(BlockPool(32), BS, policy="cost")
    cache_sequence(tree, [1] * 8, cost=5.0)  # credit 5
    cache_sequence(tree, [2] * 8, cost=4.5)  # credit 4.5: evicted first, inflation becomes 4.5
    assert tree.evict(2) == 2 and not cached(tree, [2] * 8)
    cache_sequence(tree, [3] * 8, cost=1.0)  # credit 4.5 + 1
    assert tree.evict(2) == 2
    assert cached(tree, [3] * 8) and not cached(tree, [1] * 8)


def test_unknown_policy_is_rejected():
    with pytest.raises(ValueError, match="eviction policy must be one of"):
        RadixTree(BlockPool(4), BS, policy="random")


def test_keys_validate_image_spans():
    with pytest.raises(ValueError, match="does not fit"):
        make_keys([1, 2, 3], [ImageSpan(2, 4, 1)])
    with pytest.raises(ValueError, match="image_id"):
        make_keys([1, 2, 3], [ImageSpan(0, 1, 0)])
    assert np.array_equal(make_keys([7, 8])[:, 0], [7, 8])
