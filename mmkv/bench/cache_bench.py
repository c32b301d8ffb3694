"""Radix-tree cost: match + insert of a long prompt into a big tree, and eviction.

The tree first holds ``--requests`` requests: ``--documents`` shared document prefixes of
``--doc-tokens`` tokens, each followed by a unique ``--question-tokens``-token question. Then a
``--prompt-tokens``-token prompt that starts with one of the documents is matched and inserted,
``--repeats`` times with fresh prompts; the median time per prompt token is reported. Finally every
unreferenced block is evicted in calls of ``--evict-batch`` blocks.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from cache import BlockPool, RadixTree, make_keys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--documents", type=int, default=100)
    p.add_argument("--doc-tokens", type=int, default=512)
    p.add_argument("--question-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=32_768)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--evict-batch", type=int, default=256)
    p.add_argument("--policy", default="lru")
    p.add_argument("--seed", type=int, default=0)


def _cache(tree: RadixTree, tokens: np.ndarray) -> None:
    blocks = tree.pool.allocate(len(tokens) // tree.block_size)
    tree.unlock(tree.insert(make_keys(tokens), blocks).blocks)


def run(args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(args.seed)
    bs = args.block_size
    per_request = (args.doc_tokens + args.question_tokens) // bs
    pool = BlockPool(args.requests * per_request + (args.repeats + 1) * args.prompt_tokens // bs)
    tree = RadixTree(pool, bs, policy=args.policy)
    docs = rng.integers(0, 32_000, size=(args.documents, args.doc_tokens))
    build = time.perf_counter()
    for i in range(args.requests):
        question = rng.integers(0, 32_000, size=args.question_tokens)
        _cache(tree, np.concatenate([docs[i % args.documents], question]))
    build = time.perf_counter() - build

    times = []
    for _ in range(args.repeats):
        prompt = np.concatenate([docs[rng.integers(args.documents)],
                                 rng.integers(0, 32_000, size=args.prompt_tokens - args.doc_tokens)])
        start = time.perf_counter()
        keys = make_keys(prompt)
        match = tree.match_prefix(keys)
        tree.lock(match.blocks)
        fresh = pool.allocate(len(prompt) // bs - len(match.blocks))
        result = tree.insert(keys, match.blocks + fresh)
        times.append(time.perf_counter() - start)
        tree.unlock(result.blocks)
        assert match.num_tokens == args.doc_tokens and result.num_existing == len(match.blocks)

    cached = tree.num_cached_blocks
    start = time.perf_counter()
    evicted = 0
    while (n := tree.evict(args.evict_batch)):
        evicted += n
    evict_time = time.perf_counter() - start
    assert evicted == cached and pool.num_free == pool.num_blocks
    return {
        "match_insert_us_per_token": round(statistics.median(times) / args.prompt_tokens * 1e6, 4),
        "evict_us_per_block": round(evict_time / evicted * 1e6, 3),
        "build_us_per_token": round(build / (args.requests * (args.doc_tokens + args.question_tokens)) * 1e6, 4),
        "tree_requests": args.requests,
        "prompt_tokens": args.prompt_tokens,
        "cached_blocks": cached,
        "evicted_blocks": evicted,
        "block_size": bs,
        "policy": args.policy,
    }
