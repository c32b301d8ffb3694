"""Model-agnostic KV memory: block pool, paged storage, radix-tree prefix cache, eviction."""

from cache.block_pool import BlockPool, OutOfBlocksError
from cache.eviction import POLICIES, EvictionPolicy, make_policy
from cache.keys import ImageSpan, chain_hash, make_keys
from cache.kv_cache import BlockTable, KVCache, SwappedTable
from cache.kv_storage import KVLayout, KVStorage, parse_bytes
from cache.metrics import CacheMetrics
from cache.radix_tree import InsertResult, PrefixMatch, RadixTree

__all__ = [
    "BlockPool", "BlockTable", "CacheMetrics", "EvictionPolicy", "ImageSpan", "InsertResult",
    "KVCache", "KVLayout", "KVStorage", "OutOfBlocksError", "POLICIES", "PrefixMatch", "RadixTree",
    "SwappedTable", "chain_hash", "make_keys", "make_policy", "parse_bytes",
]
