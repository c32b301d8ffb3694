"""Fixed pool of KV block ids with reference counts.

Every block is in exactly one of three states:

* **free**: refcount 0, not cached; it sits on the free stack and ``allocate`` may hand it out.
* **evictable**: refcount 0 and cached (held by the radix tree); its data is still valid and a
  later request may reuse it, but the tree may evict it to make room.
* **in use**: refcount > 0 (cached or not); nobody may evict or reallocate it.

``free + evictable + in_use == num_blocks`` always holds and ``check_integrity`` proves it.
Allocation and release are O(1) per block (a stack of free ids, like vLLM's free queue without the
LRU ordering, which the radix tree's eviction policy provides instead).
"""

from __future__ import annotations

from typing import Callable, Iterable


class OutOfBlocksError(RuntimeError):
    """Raised when more blocks are requested than are free."""


RefListener = Callable[[int, bool], None]
"""Called as ``listener(block, busy)`` when a *cached* block's refcount goes 0 -> 1 (busy=True)
or 1 -> 0 (busy=False)."""


class BlockPool:
    """Reference-counted block ids ``0 .. num_blocks-1``.

    Guarantees: a block handed out by ``allocate`` is free and gets refcount 1; a block returns to
    the free stack exactly when its refcount reaches 0 and it is not cached; the counters of free,
    evictable and in-use blocks always add up to ``num_blocks``.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.refcount: list[int] = [0] * num_blocks
        self.cached: list[bool] = [False] * num_blocks
        # Low ids are handed out first, which keeps live data near the start of the pool.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._num_evictable = 0
        self._listener: RefListener | None = None

    # -- counts ---------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        return self._num_evictable

    @property
    def num_in_use(self) -> int:
        return self.num_blocks - len(self._free) - self._num_evictable

    def set_listener(self, listener: RefListener) -> None:
        """Register the cache owner (the radix tree) to hear busy/idle changes of cached blocks."""
        self._listener = listener

    # -- allocation -----------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks, each with refcount 1."""
        if n > len(self._free):
            raise OutOfBlocksError(f"requested {n} blocks, only {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self.refcount[b] = 1
        return out

    def incref(self, blocks: Iterable[int]) -> None:
        """Add one reference to each block (a block may not be free)."""
        ref, cached = self.refcount, self.cached
        for b in blocks:
            if ref[b] == 0:
                if not cached[b]:
                    raise ValueError(f"incref of free block {b}")
                self._num_evictable -= 1
                if self._listener is not None:
                    self._listener(b, True)
            ref[b] += 1

    def decref(self, blocks: Iterable[int]) -> None:
        """Drop one reference from each block; unreferenced blocks become free or evictable."""
        ref, cached = self.refcount, self.cached
        for b in blocks:
            if ref[b] <= 0:
                raise ValueError(f"decref of unreferenced block {b}")
            ref[b] -= 1
            if ref[b] == 0:
                if cached[b]:
                    self._num_evictable += 1
                    if self._listener is not None:
                        self._listener(b, False)
                else:
                    self._free.append(b)

    # -- cache membership (driven by the radix tree) --------------------------------------------
    def mark_cached(self, block: int) -> None:
        """The tree now holds ``block``; it must currently be in use."""
        if self.refcount[block] == 0 or self.cached[block]:
            raise ValueError(f"block {block} cannot be cached (ref={self.refcount[block]}, "
                             f"cached={self.cached[block]})")
        self.cached[block] = True

    def uncache(self, block: int) -> None:
        """The tree dropped ``block``; if nobody references it, it becomes free."""
        if not self.cached[block]:
            raise ValueError(f"block {block} is not cached")
        self.cached[block] = False
        if self.refcount[block] == 0:
            self._num_evictable -= 1
            self._free.append(block)

    # -- compaction -----------------------------------------------------------------------------
    def relocate(self, mapping: dict[int, int]) -> None:
        """Move the state of each ``old`` block to ``new``; every ``new`` must be free now.

        Afterwards the freed ``old`` ids are free; the free stack hands out low ids first.
        """
        free = set(self._free)
        for new in mapping.values():
            if new not in free:
                raise ValueError(f"relocation target {new} is not free")
        ref, cached = list(self.refcount), list(self.cached)
        for old in mapping:
            self.refcount[old], self.cached[old] = 0, False
        for old, new in mapping.items():
            self.refcount[new], self.cached[new] = ref[old], cached[old]
        live = {b for b in range(self.num_blocks) if self.refcount[b] or self.cached[b]}
        self._free = [b for b in range(self.num_blocks - 1, -1, -1) if b not in live]

    def resize(self, num_blocks: int) -> None:
        """Grow the pool (new ids are handed out last), or shrink it to ``num_blocks`` when every
        block from there on is free (compact first)."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        live = [b for b in range(num_blocks, self.num_blocks) if self.refcount[b] or self.cached[b]]
        if live:
            raise ValueError(f"cannot shrink to {num_blocks} blocks: block {live[0]} is live")
        if num_blocks >= self.num_blocks:
            self._free[:0] = range(num_blocks - 1, self.num_blocks - 1, -1)
        else:
            self._free = [b for b in self._free if b < num_blocks]
        grow = num_blocks - self.num_blocks
        self.refcount = self.refcount[:num_blocks] + [0] * max(grow, 0)
        self.cached = self.cached[:num_blocks] + [False] * max(grow, 0)
        self.num_blocks = num_blocks

    # -- checks ---------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Prove free + evictable + in use == total and that no block is in two states."""
        free = self._free
        assert len(set(free)) == len(free), "a block is on the free stack twice"
        for b in free:
            assert self.refcount[b] == 0 and not self.cached[b], f"free block {b} is live"
        evictable = sum(1 for b in range(self.num_blocks) if self.cached[b] and self.refcount[b] == 0)
        in_use = sum(1 for r in self.refcount if r > 0)
        assert all(r >= 0 for r in self.refcount), "negative refcount"
        assert evictable == self._num_evictable, f"evictable {self._num_evictable} != {evictable}"
        assert len(free) + evictable + in_use == self.num_blocks, (
            f"free {len(free)} + evictable {evictable} + in use {in_use} != {self.num_blocks}")
