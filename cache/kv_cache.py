"""One model's KV cache: block pool, physical storage and prefix tree, kept consistent.

This is the interface the scheduler uses. Sequences own a ``BlockTable``; the cache hands out
blocks, shares them (prefix hits, forks), copies a shared block before it is written
(copy-on-write), swaps tables to the host tier and back, and compacts the pool (which is how it
grows or shrinks without losing what is live).

Invariants: a block is written only while its refcount is 1 and it is not cached (shared blocks are
immutable); every allocation either succeeds whole or raises ``OutOfBlocksError`` and changes
nothing; ``check_integrity`` holds between any two calls.

The extra stores (a draft model's K/V of the same blocks) are filled lazily: ``draft_slots[b]``
counts the leading slots of block ``b`` whose extra-store K/V is current for the block's tokens.
It is 0 for a fresh block, follows its block through copies and compactions (at most the slots
copied), and only grows otherwise (``mark_draft_written``). Writing the extra store of a shared
block is allowed: it fills in K/V the block's tokens determine, and changes nothing the target
reads. A count that is too low only costs recomputation; none is ever too high.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from cache import kv_format
from cache.block_pool import BlockPool, OutOfBlocksError
from cache.kv_storage import KVLayout, KVStorage, parse_bytes
from cache.metrics import CacheMetrics
from cache.radix_tree import RadixTree


@dataclass(slots=True)
class BlockTable:
    """A sequence's blocks in order; ``num_tokens`` slots of them hold KV."""

    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0

    def remap(self, mapping: dict[int, int]) -> None:
        """Apply a compaction's ``old -> new`` block renaming."""
        self.blocks = [mapping.get(b, b) for b in self.blocks]


@dataclass(slots=True)
class SwappedTable:
    """A table parked in the host tier: ``blocks`` keeps the device blocks it shares with other
    tables (still referenced, so they stay put) and ``-1`` where the data moved to the next of
    ``host_slots``."""

    blocks: list[int]
    host_slots: list[int]
    num_tokens: int

    def remap(self, mapping: dict[int, int]) -> None:
        """Apply a compaction's ``old -> new`` renaming to the blocks still on the device."""
        self.blocks = [mapping.get(b, b) if b >= 0 else b for b in self.blocks]


class KVCache:
    """Blocks, KV data and prefix tree of one model.

    Guarantees: KV read through a table is the KV written through it or through a table it shares
    with (prefix hits, forks), whatever evictions, copies, swaps or compactions happen in between.
    """

    def __init__(self, layout: KVLayout, num_blocks: int, device: str | torch.device = "cpu",
                 num_host_blocks: int = 0, policy: str = "lru",
                 extra_layouts: Sequence[KVLayout] = ()) -> None:
        self.layout = layout
        self.block_size = layout.block_size
        self.metrics = CacheMetrics()
        self.pool = BlockPool(num_blocks)
        self.host_pool = BlockPool(num_host_blocks) if num_host_blocks else None
        self.storage = KVStorage(layout, num_blocks, device, num_host_blocks, extra_layouts)
        self.draft_slots = np.zeros(num_blocks, dtype=np.int64)
        self.tree = RadixTree(self.pool, layout.block_size, policy, block_cost=layout.num_layers,
                              metrics=self.metrics)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across every store."""
        return self.storage.bytes_per_block

    @classmethod
    def from_memory(cls, layout: KVLayout, memory: str | int, host_memory: str | int = 0,
                    device: str | torch.device = "cpu", policy: str = "lru",
                    extra_layouts: Sequence[KVLayout] = ()) -> "KVCache":
        """Size the device pool (and the host tier) from byte budgets such as ``"2GiB"``."""
        per_block = layout.bytes_per_block + sum(lay.bytes_per_block for lay in extra_layouts)
        blocks = {name: parse_bytes(budget) // per_block
                  for name, budget in (("kv memory", memory), ("host memory", host_memory or 1))}
        if blocks["kv memory"] < 1:
            raise ValueError(f"kv memory {memory!r} holds no block of {per_block} bytes")
        host = blocks["host memory"] if host_memory else 0
        return cls(layout, blocks["kv memory"], device, host, policy, extra_layouts)

    # -- allocation -----------------------------------------------------------------------------
    def num_available(self) -> int:
        """Blocks that ``allocate`` can hand out now (free plus evictable)."""
        return self.pool.num_free + self.pool.num_evictable

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks (refcount 1), evicting cached blocks if needed."""
        short = n - self.pool.num_free
        if short > 0:
            self.tree.evict(short)
        fresh = self.pool.allocate(n)
        self.draft_slots[fresh] = 0
        return fresh

    def blocks_needed(self, table: BlockTable, num_new_tokens: int) -> int:
        """Blocks ``append_slots(table, num_new_tokens)`` would allocate."""
        bs = self.block_size
        grow = -(-(table.num_tokens + num_new_tokens) // bs) - len(table.blocks)
        return max(grow, 0) + self._needs_copy(table)

    def append_slots(self, table: BlockTable, n: int) -> list[int]:
        """Reserve ``n`` more token slots at the end of ``table`` and return their flat slot ids
        (``block * block_size + offset``). A shared last block is copied first."""
        need = self.blocks_needed(table, n)
        if need > self.num_available():
            raise OutOfBlocksError(f"need {need} blocks, {self.num_available()} available")
        fresh = self.allocate(need)
        if self._needs_copy(table):
            self._copy_on_write(table, fresh.pop())
        table.blocks.extend(fresh)
        bs, start = self.block_size, table.num_tokens
        table.num_tokens += n
        blocks = table.blocks
        return [blocks[t // bs] * bs + t % bs for t in range(start, start + n)]

    def truncate(self, table: BlockTable, num_tokens: int) -> None:
        """Give back reserved slots past ``num_tokens`` (rejected speculation); whole blocks past
        them are released."""
        if not 0 <= num_tokens <= table.num_tokens:
            raise ValueError(f"cannot truncate a table of {table.num_tokens} tokens to {num_tokens}")
        keep = -(-num_tokens // self.block_size)
        self.pool.decref(table.blocks[keep:])
        del table.blocks[keep:]
        table.num_tokens = num_tokens

    def fork(self, table: BlockTable) -> BlockTable:
        """A second table sharing every block of ``table`` (parallel sampling)."""
        self.pool.incref(table.blocks)
        return BlockTable(list(table.blocks), table.num_tokens)

    def free(self, table: BlockTable) -> None:
        """Release the table's references; cached blocks stay in the tree as evictable."""
        self.pool.decref(table.blocks)
        table.blocks, table.num_tokens = [], 0

    def _needs_copy(self, table: BlockTable) -> bool:
        if table.num_tokens % self.block_size == 0:
            return False
        last = table.blocks[-1]
        return self.pool.refcount[last] > 1 or self.pool.cached[last]

    def _copy_on_write(self, table: BlockTable, fresh: int) -> None:
        last = table.blocks[-1]
        self._copy_block(last, fresh, table.num_tokens % self.block_size)
        self.pool.decref([last])
        table.blocks[-1] = fresh
        self.metrics.cow_copies += 1

    def _copy_block(self, src: int, dst: int, num_tokens: int) -> None:
        """The first ``num_tokens`` slots of ``src`` into ``dst``; of the extra stores only those
        they hold current (``draft_slots``: a draft that decoded nothing copies nothing)."""
        held = min(int(self.draft_slots[src]), num_tokens)
        self.storage.copy_blocks([src], [dst], num_tokens=num_tokens, extra_tokens=held)
        self.draft_slots[dst] = held

    # -- the extra stores' lazy fill ------------------------------------------------------------
    def mark_draft_written(self, table: BlockTable, start: int, end: int) -> None:
        """The extra stores now hold current K/V for positions ``[start, end)`` of ``table`` (and,
        the caller vouches, for every position before ``start``)."""
        bs, slots = self.block_size, self.draft_slots
        for k in range(start // bs, -(-end // bs)):
            block = table.blocks[k]
            if slots[block] >= start - k * bs:  # contiguous with what the block already holds
                slots[block] = max(slots[block], min(bs, end - k * bs))

    def draft_written_prefix(self, table: BlockTable, limit: int) -> int:
        """How many leading positions of ``table`` (at most ``limit``) the extra stores hold."""
        bs, written = self.block_size, 0
        for block in table.blocks:
            if written >= limit:
                break
            filled = int(self.draft_slots[block])
            written += filled
            if filled < bs:
                break
        return min(written, limit)

    # -- prefix cache ---------------------------------------------------------------------------
    def acquire_prefix(self, keys: np.ndarray, namespace: bytes = b"") -> BlockTable:
        """A table holding the longest cached prefix of ``keys``: shared full blocks plus, when the
        match goes on inside a cached block, a private block with the matching slots copied.

        Pass the keys of the tokens that may be served from cache (for a prompt, all but its last
        token, whose logits must be computed).
        """
        match = self.tree.match_prefix(keys, namespace)
        self.tree.lock(match.blocks)
        table = BlockTable(list(match.blocks), match.num_tokens)
        if match.partial_tokens:
            self.tree.lock([match.partial_block])  # so allocating cannot evict it
            try:
                [fresh] = self.allocate(1)
            except OutOfBlocksError:  # no room: those slots are computed instead
                fresh = None
            if fresh is not None:
                self._copy_block(match.partial_block, fresh, match.partial_tokens)
                table.blocks.append(fresh)
                table.num_tokens += match.partial_tokens
            self.tree.unlock([match.partial_block])
        return table

    def cache_prefix(self, table: BlockTable, keys: np.ndarray, namespace: bytes = b"",
                     cost_per_block: float | None = None) -> int:
        """Insert the table's full blocks (holding ``keys``) into the tree; the table then points at
        the tree's blocks. Returns how many were cached already."""
        n = min(table.num_tokens, keys.shape[0]) // self.block_size
        if n == 0:
            return 0
        result = self.tree.insert(keys[: n * self.block_size], table.blocks[:n], namespace,
                                  cost_per_block)
        table.blocks[:n] = result.blocks
        return result.num_existing

    # -- host tier ------------------------------------------------------------------------------
    def swap_out(self, table: BlockTable) -> SwappedTable:
        """Move the table's blocks that nobody else references to host slots and release them;
        blocks shared with other tables stay on the device (moving them would free nothing)."""
        ref = self.pool.refcount
        moved = [b for b in table.blocks if ref[b] == 1]
        if moved and self.host_pool is None:
            raise OutOfBlocksError("no host tier: build the cache with host memory to swap")
        slots = self.host_pool.allocate(len(moved)) if moved else []
        self.storage.swap_out(moved, slots)
        self.metrics.swapped_out_blocks += len(moved)
        swapped = SwappedTable([-1 if ref[b] == 1 else b for b in table.blocks], slots,
                               table.num_tokens)
        self.pool.decref(moved)
        table.blocks, table.num_tokens = [], 0
        return swapped

    def swap_in(self, swapped: SwappedTable) -> BlockTable:
        """Bring a swapped table back (fresh device blocks for the moved part) and release its
        host slots."""
        n = len(swapped.host_slots)
        if n > self.num_available():
            raise OutOfBlocksError(f"swap-in needs {n} blocks, {self.num_available()} available")
        fresh = self.allocate(n)
        self.storage.swap_in(swapped.host_slots, fresh)
        self.host_pool.decref(swapped.host_slots)
        self.metrics.swapped_in_blocks += n
        it = iter(fresh)
        return BlockTable([next(it) if b < 0 else b for b in swapped.blocks], swapped.num_tokens)

    def drop_swapped(self, swapped: SwappedTable) -> None:
        """Release a swapped table without bringing it back."""
        self.pool.decref([b for b in swapped.blocks if b >= 0])
        if swapped.host_slots:
            self.host_pool.decref(swapped.host_slots)

    # -- compaction -----------------------------------------------------------------------------
    def compact(self) -> dict[int, int]:
        """Move every live (in-use or cached) block to the low end of the pool so the tail is free.

        Returns the ``old -> new`` renaming; callers apply it to their tables (``BlockTable.remap``).
        """
        ref, cached = self.pool.refcount, self.pool.cached
        live = [b for b in range(self.pool.num_blocks) if ref[b] or cached[b]]
        n_live = len(live)
        movers = [b for b in live if b >= n_live]
        holes = [b for b in range(n_live) if not (ref[b] or cached[b])]
        mapping = dict(zip(movers, holes))
        self.storage.move_blocks(mapping)
        self.draft_slots[holes[:len(movers)]] = self.draft_slots[movers]
        self.pool.relocate(mapping)
        self.tree.relocate(mapping)
        self.metrics.compactions += 1
        return mapping

    def resize(self, num_blocks: int) -> dict[int, int]:
        """Grow or shrink the device pool to ``num_blocks``, keeping every block in use and as
        many cached blocks as fit (the eviction policy chooses which go). Live blocks are
        compacted to the low end first; returns that ``old -> new`` renaming for the callers'
        tables. Raises ``ValueError``, changing nothing, when the blocks in use exceed
        ``num_blocks``."""
        if num_blocks < max(self.pool.num_in_use, 1):
            raise ValueError(f"cannot resize the KV pool to {num_blocks} blocks: "
                             f"{self.pool.num_in_use} are in use")
        excess = self.pool.num_blocks - self.pool.num_free - num_blocks
        if excess > 0:
            self.tree.evict(excess)
        mapping = self.compact()
        self.pool.resize(num_blocks)
        self.tree.resize(num_blocks)
        self.storage.resize(num_blocks)
        slots = np.zeros(num_blocks, dtype=np.int64)
        kept = min(num_blocks, self.draft_slots.shape[0])
        slots[:kept] = self.draft_slots[:kept]
        self.draft_slots = slots
        return mapping

    def reset_cache(self) -> None:
        """Forget every cached prefix and every count: each evictable block becomes free and the
        metrics start from 0; blocks in use stay as they are."""
        self.tree.evict(self.pool.num_evictable)
        self.metrics.reset()

    # -- reporting ------------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        pool = self.pool
        return {"blocks_total": pool.num_blocks, "blocks_free": pool.num_free,
                "blocks_evictable": pool.num_evictable, "blocks_in_use": pool.num_in_use,
                **self.metrics.as_dict()}

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        self.tree.check_integrity()
        slots = self.draft_slots
        assert slots.shape == (self.pool.num_blocks,), "draft_slots does not cover the pool"
        assert slots.min(initial=0) >= 0 and slots.max(initial=0) <= self.block_size, \
            "draft_slots out of range"
        if self.host_pool is not None:
            self.host_pool.check_integrity()
        self._check_scales()

    def _check_scales(self) -> None:
        """Every int8 row of a block in use or cached carries a finite scale of at least 0
        (``cache.kv_format``): codes written over a scale, or a block moved without its last
        bytes, break it."""
        int8 = [(i, layer) for i, layer in enumerate(self.storage.layers) if layer.dtype == torch.int8]
        held = [b for b, count in enumerate(self.pool.refcount) if count or self.pool.cached[b]] if int8 else []
        if not held:
            return
        index = torch.tensor(held, device=self.storage.device)
        for i, layer in int8:
            scales = kv_format.scales(layer.index_select(0, index))
            assert bool(torch.isfinite(scales).all() and (scales >= 0).all()), \
                f"cache layer {i} holds an int8 row whose scale is negative or not finite"
