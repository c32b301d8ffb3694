"""A tour of mmkv's KV cache without a model: requests that share document prefixes reuse each
other's blocks, a small pool forces evictions, and compaction packs live blocks together.

Run: ``make demo`` (or ``python examples/cache_demo.py``).
"""

from __future__ import annotations

import numpy as np
import torch

from cache import BlockTable, KVCache, KVLayout, make_keys

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=8, block_size=16)


def serve(cache: KVCache, tokens: np.ndarray) -> tuple[BlockTable, int]:
    """Reuse the cached prefix, 'compute' the rest (write its KV), cache the result."""
    keys = make_keys(tokens)
    table = cache.acquire_prefix(keys[:-1])  # the last prompt token is always computed
    reused = table.num_tokens
    slots = cache.append_slots(table, len(tokens) - reused)
    bs = LAYOUT.block_size
    for layer in cache.storage.layers:  # stand-in for the model: KV = token id
        for t, slot in zip(tokens[reused:], slots):
            layer[slot // bs, :, slot % bs] = float(t)
    cache.cache_prefix(table, keys)
    return table, reused


def main() -> None:
    rng = np.random.default_rng(0)
    cache = KVCache.from_memory(LAYOUT, "384KiB", host_memory="256KiB")
    print(f"pool: {cache.pool.num_blocks} blocks of {LAYOUT.block_size} tokens "
          f"({LAYOUT.bytes_per_block} bytes each), policy {cache.tree.policy.name}\n")
    documents = [rng.integers(100, 30_000, size=200) for _ in range(4)]
    for round_ in range(2):
        for d, doc in enumerate(documents):
            for q in range(3):
                question = rng.integers(100, 30_000, size=12)
                table, reused = serve(cache, np.concatenate([doc, question]))
                print(f"round {round_} doc {d} question {q}: {len(doc) + 12:4d} tokens, "
                      f"{reused:4d} reused, {len(doc) + 12 - reused:4d} computed")
                cache.free(table)
    s = cache.stats()
    print(f"\nhits {s['hits']}, misses {s['misses']}, tokens reused {s['hit_tokens']}, "
          f"blocks evicted {s['evictions']}")

    cache.tree.evict(20)  # leaves holes across the pool
    live = [serve(cache, np.concatenate([documents[0], rng.integers(100, 30_000, size=40)]))[0]
            for _ in range(2)]
    before = [torch.stack([layer[t.blocks] for layer in cache.storage.layers]) for t in live]
    mapping = cache.compact()
    for table in live:
        table.remap(mapping)
    after = [torch.stack([layer[t.blocks] for layer in cache.storage.layers]) for t in live]
    n_live = cache.pool.num_blocks - cache.pool.num_free
    print(f"compaction moved {len(mapping)} blocks: the {n_live} live and cached blocks hold ids "
          f"0..{n_live - 1}, a free tail of {cache.pool.num_free}; "
          f"KV identical after the move: {all(torch.equal(a, b) for a, b in zip(before, after))}")
    swapped = cache.swap_out(live[0])
    back = cache.swap_in(swapped)
    print(f"swapped a {back.num_tokens}-token sequence to host and back: "
          f"KV identical: {torch.equal(torch.stack([l[back.blocks] for l in cache.storage.layers]), after[0])}")
    for table in (back, live[1]):
        cache.free(table)
    cache.check_integrity()
    print("integrity: free + evictable + in use == total:",
          f"{cache.pool.num_free} + {cache.pool.num_evictable} + {cache.pool.num_in_use} == {cache.pool.num_blocks}")


if __name__ == "__main__":
    main()
