"""Radix tree of KV blocks keyed by token ids, image tags and namespace.

Edges hold whole blocks. Each namespace (cache salt) has its own root, so keys of different
tenants never meet. Children are found by the chained hash of their first block and every hash hit
is confirmed by comparing the key bytes, so even a constant hash function cannot produce a wrong
match (it only makes lookups slower).

Invariants kept (``check_integrity`` proves them):

* every cached block sits in exactly one node, and the pool marks exactly those blocks cached;
* ``node.busy`` is the number of the node's blocks with refcount > 0;
* the evictable set is exactly the leaves whose blocks are all unreferenced;
* a node's blocks are all referenced or all unreferenced, and a referenced node's parent is
  referenced: every unreferenced cached block can be evicted (leaves first);
* the tree is prefix-closed: eviction only takes blocks from the tail of an evictable leaf.

References are the pool's refcounts: whoever uses matched blocks ``lock``s them (one reference each)
and ``unlock``s them when done. A block with a reference is never evicted.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, Iterator, NamedTuple

import numpy as np

from cache.block_pool import BlockPool
from cache.eviction import EvictionPolicy, EvictionQueue, make_policy
from cache.keys import block_keys, chain_hash, common_rows, namespace_hash
from cache.metrics import CacheMetrics

HashFn = Callable[[int, bytes], int]
_node_ids = itertools.count()


@dataclass(slots=True, eq=False)
class Node:
    """An edge of whole blocks; ``seed`` is the chained hash just before its first block."""

    parent: "Node | None"
    seed: int
    blocks: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    children: dict[int, list["Node"]] = field(default_factory=dict)
    created: int = 0
    last_access: int = 0
    hits: int = 0
    cost_per_block: float = 0.0
    credit: float = 0.0
    busy: int = 0
    uid: int = field(default_factory=lambda: next(_node_ids))

    @property
    def last_hash(self) -> int:
        return self.hashes[-1] if self.hashes else self.seed

    def child_nodes(self) -> Iterator["Node"]:
        for bucket in self.children.values():
            yield from bucket


class PrefixMatch(NamedTuple):
    """Longest cached prefix of a query.

    ``blocks`` are whole matching blocks (``num_tokens`` tokens). When the match goes on inside the
    next cached block, ``partial_block`` is that block and ``partial_tokens`` how many of its
    leading slots match; the caller may copy them instead of recomputing.
    """

    blocks: list[int]
    num_tokens: int
    partial_block: int | None
    partial_tokens: int


class InsertResult(NamedTuple):
    """``blocks`` are the tree's blocks for the inserted prefix; the first ``num_existing`` were
    already cached (the caller's duplicates of those were released)."""

    blocks: list[int]
    num_existing: int


class RadixTree:
    """Prefix cache over a ``BlockPool``.

    Guarantees: a match returns only blocks whose keys equal the query's keys (no false sharing);
    ``insert`` never stores two blocks for the same key path; ``evict`` frees only unreferenced
    blocks, leaf tails first, in the order of the chosen policy.
    """

    def __init__(self, pool: BlockPool, block_size: int, policy: str | EvictionPolicy = "lru",
                 block_cost: float = 1.0, metrics: CacheMetrics | None = None,
                 hash_fn: HashFn | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.pool = pool
        self.block_size = block_size
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.default_cost_per_block = block_cost * block_size
        self.metrics = metrics if metrics is not None else CacheMetrics()
        self._hash = hash_fn if hash_fn is not None else chain_hash
        self._roots: dict[bytes, Node] = {}
        self._node_of: list[Node | None] = [None] * pool.num_blocks
        self._evictable = EvictionQueue(self.policy)
        self._clock = 0
        pool.set_listener(self._on_ref_change)

    # -- queries --------------------------------------------------------------------------------
    @property
    def num_cached_blocks(self) -> int:
        return sum(len(n.blocks) for n in self._nodes())

    def match_prefix(self, keys: np.ndarray, namespace: bytes = b"") -> PrefixMatch:
        """Longest cached prefix of ``keys`` (see ``cache.keys``), in whole blocks plus a partial
        block. Matched nodes count as used now; a match that ends inside an edge splits it."""
        self._clock += 1
        bkeys = block_keys(keys, self.block_size)
        root = self._roots.get(namespace)
        if root is None:
            self.metrics.misses += 1
            return PrefixMatch([], 0, None, 0)
        node, blocks = self._walk(root, bkeys, hit=True)
        start = len(blocks) * self.block_size
        tail = np.ascontiguousarray(keys[start:start + self.block_size]).tobytes()
        partial_block, partial_tokens = self._partial(node, tail) if tail else (None, 0)
        matched = start + partial_tokens
        self.metrics.hits += matched > 0
        self.metrics.misses += matched == 0
        self.metrics.hit_tokens += matched
        return PrefixMatch(blocks, start, partial_block, partial_tokens)

    def cached_length(self, keys: np.ndarray, namespace: bytes = b"") -> int:
        """How many leading ``keys`` the tree holds now (whole blocks and a partial block, as
        ``match_prefix`` would match), without counting a use, touching a node or splitting one."""
        root = self._roots.get(namespace)
        if root is None:
            return 0
        bkeys, bs = block_keys(keys, self.block_size), self.block_size
        node, i = root, 0
        while i < len(bkeys):
            child = self._child(node, bkeys[i])
            if child is None:
                break
            edge, j = child.keys, 1
            while j < len(edge) and i + j < len(bkeys) and edge[j] == bkeys[i + j]:
                j += 1
            i += j
            if j < len(edge):  # the match ends inside this edge: its next block may share rows
                tail = np.ascontiguousarray(keys[i * bs:(i + 1) * bs]).tobytes()
                return i * bs + (common_rows(tail, edge[j]) if tail else 0)
            node = child
        tail = np.ascontiguousarray(keys[i * bs:(i + 1) * bs]).tobytes()
        rows = max((common_rows(tail, c.keys[0]) for c in node.child_nodes()), default=0) if tail else 0
        return i * bs + rows

    def lock(self, blocks: list[int]) -> None:
        """Take one reference on each block so it cannot be evicted."""
        self.pool.incref(blocks)

    def unlock(self, blocks: list[int]) -> None:
        """Drop a reference taken by ``lock``."""
        self.pool.decref(blocks)

    # -- updates --------------------------------------------------------------------------------
    def insert(self, keys: np.ndarray, blocks: list[int], namespace: bytes = b"",
               cost_per_block: float | None = None) -> InsertResult:
        """Cache ``blocks`` (full blocks holding ``keys[:len(blocks) * block_size]``).

        The caller holds one reference to each of ``blocks`` before the call and one reference to
        each of the returned blocks after it: where the tree already had a block for a key, the
        caller's duplicate is released and the tree's block referenced instead.
        """
        n = len(blocks)
        if keys.shape[0] < n * self.block_size:
            raise ValueError(f"{n} blocks need {n * self.block_size} keys, got {keys.shape[0]}")
        self._clock += 1
        bkeys = block_keys(keys[: n * self.block_size], self.block_size)
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = Node(parent=None, seed=namespace_hash(namespace))
        node, out = self._walk(root, bkeys, hit=False)
        existing = len(out)
        for mine, cached in zip(blocks, out):
            if mine != cached:
                self.pool.incref([cached])
                self.pool.decref([mine])
        if existing < n:
            cost = self.default_cost_per_block if cost_per_block is None else cost_per_block
            self._add_leaf(node, bkeys[existing:], blocks[existing:], cost)
            out.extend(blocks[existing:])
        return InsertResult(out, existing)

    def evict(self, num_blocks: int) -> int:
        """Free up to ``num_blocks`` unreferenced blocks in policy order; returns how many."""
        evicted = 0
        while evicted < num_blocks and (node := self._evictable.pop()) is not None:
            take = min(len(node.blocks), num_blocks - evicted)
            first_hash = node.hashes[0]
            for _ in range(take):
                block = node.blocks.pop()
                node.keys.pop()
                node.hashes.pop()
                self._node_of[block] = None
                self.pool.uncache(block)
            evicted += take
            self.policy.evicted(node)
            if node.blocks:
                self._evictable.touched(node)
            else:
                self._detach(node, first_hash)
        self.metrics.evictions += evicted
        return evicted

    def relocate(self, mapping: dict[int, int]) -> None:
        """Rename cached blocks ``old -> new`` after the pool and storage moved them."""
        for node in self._nodes():
            node.blocks = [mapping.get(b, b) for b in node.blocks]
        self._node_of = [None] * self.pool.num_blocks
        for node in self._nodes():
            for b in node.blocks:
                self._node_of[b] = node

    def resize(self, num_blocks: int) -> None:
        """Follow the pool to ``num_blocks`` ids (no cached block may sit past the new end)."""
        if any(node is not None for node in self._node_of[num_blocks:]):
            raise ValueError(f"cannot shrink to {num_blocks} blocks: a cached block lies beyond")
        self._node_of = self._node_of[:num_blocks] + [None] * (num_blocks - len(self._node_of))

    # -- internals ------------------------------------------------------------------------------
    def _walk(self, node: Node, bkeys: list[bytes], hit: bool) -> tuple[Node, list[int]]:
        """Follow ``bkeys`` down from ``node``; touch and collect every matched block; split the
        edge where the match ends inside it. Returns the last matched node and the blocks."""
        blocks: list[int] = []
        i = 0
        while i < len(bkeys):
            child = self._child(node, bkeys[i])
            if child is None:
                return node, blocks
            j = 1
            edge = child.keys
            while j < len(edge) and i + j < len(bkeys) and edge[j] == bkeys[i + j]:
                j += 1
            split = j < len(edge)
            if split:
                child = self._split(child, j)
            self._touch(child, hit)
            blocks.extend(child.blocks)
            node, i = child, i + j
            if split:
                break
        return node, blocks

    def _child(self, node: Node, key: bytes) -> Node | None:
        for child in node.children.get(self._hash(node.last_hash, key), ()):
            if child.keys[0] == key:
                return child
        return None

    def _partial(self, node: Node, tail: bytes) -> tuple[int | None, int]:
        """The cached block right after ``node`` that shares the most leading rows with ``tail``.

        Its node is cut right after it, so a caller that locks the block while copying from it
        leaves the rest of that edge evictable."""
        best, best_rows = None, 0
        for child in node.child_nodes():
            rows = common_rows(tail, child.keys[0])
            if rows > best_rows:
                best, best_rows = child, rows
        if best is None:
            return None, 0
        if len(best.blocks) > 1:
            best = self._split(best, 1)
        return best.blocks[0], best_rows

    def _touch(self, node: Node, hit: bool) -> None:
        node.last_access = self._clock
        node.hits += hit
        self.policy.touch(node)
        self._evictable.touched(node)

    def _split(self, node: Node, j: int) -> Node:
        """Cut ``node``'s edge after ``j`` blocks; the new upper node is returned."""
        upper = Node(parent=node.parent, seed=node.seed, blocks=node.blocks[:j], keys=node.keys[:j],
                     hashes=node.hashes[:j], created=node.created, last_access=node.last_access,
                     hits=node.hits, cost_per_block=node.cost_per_block, credit=node.credit)
        bucket = node.parent.children[node.hashes[0]]
        bucket[bucket.index(node)] = upper
        node.parent, node.seed = upper, upper.hashes[-1]
        node.blocks, node.keys, node.hashes = node.blocks[j:], node.keys[j:], node.hashes[j:]
        upper.children[node.hashes[0]] = [node]
        ref = self.pool.refcount
        for b in upper.blocks:
            self._node_of[b] = upper
            upper.busy += ref[b] > 0
        node.busy -= upper.busy
        self._refresh(node)
        return upper

    def _add_leaf(self, parent: Node, bkeys: list[bytes], blocks: list[int], cost: float) -> None:
        hashes, h = [], parent.last_hash
        for k in bkeys:
            h = self._hash(h, k)
            hashes.append(h)
        leaf = Node(parent=parent, seed=parent.last_hash, blocks=list(blocks), keys=list(bkeys),
                    hashes=hashes, created=self._clock, last_access=self._clock, cost_per_block=cost)
        parent.children.setdefault(hashes[0], []).append(leaf)
        ref = self.pool.refcount
        for b in blocks:
            self.pool.mark_cached(b)
            self._node_of[b] = leaf
            leaf.busy += ref[b] > 0
        self.policy.touch(leaf)
        self._refresh(parent)
        self._refresh(leaf)

    def _detach(self, node: Node, first_hash: int) -> None:
        """Remove an emptied leaf (whose first block hashed to ``first_hash``) from its parent."""
        parent = node.parent
        bucket = parent.children[first_hash]
        bucket.remove(node)
        if not bucket:
            del parent.children[first_hash]
        self._evictable.discard(node)
        self._refresh(parent)

    def _on_ref_change(self, block: int, busy: bool) -> None:
        node = self._node_of[block]
        node.busy += 1 if busy else -1
        self._refresh(node)

    def _refresh(self, node: Node) -> None:
        if node.parent is not None and node.busy == 0 and node.blocks and not node.children:
            self._evictable.add(node)
        else:
            self._evictable.discard(node)

    def _nodes(self) -> Iterator[Node]:
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.child_nodes())

    # -- checks ---------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Prove the invariants listed in the module docstring."""
        seen: set[int] = set()
        ref, cached = self.pool.refcount, self.pool.cached
        for node in self._nodes():
            assert len(node.blocks) == len(node.keys) == len(node.hashes)
            h = node.seed
            for b, k, bh in zip(node.blocks, node.keys, node.hashes):
                assert b not in seen, f"block {b} cached twice"
                seen.add(b)
                assert cached[b], f"block {b} in the tree but not marked cached"
                assert self._node_of[b] is node, f"block {b} maps to the wrong node"
                h = self._hash(h, k)
                assert h == bh, f"block {b} has a stale hash"
            assert node.busy == sum(ref[b] > 0 for b in node.blocks), "node.busy is stale"
            # Referenced blocks form root paths cut at node boundaries, so every unreferenced
            # cached block can be evicted: the pool's evictable count is what eviction can free.
            assert node.busy in (0, len(node.blocks)), "a node is partly referenced"
            assert node.busy == 0 or node.parent is None or node.parent.parent is None \
                or node.parent.busy, "a referenced node has an unreferenced parent"
            for child in node.child_nodes():
                assert child.parent is node and child.seed == node.last_hash
            should = node.parent is not None and node.busy == 0 and bool(node.blocks) and not node.children
            assert should == (node in self._evictable), "evictable set is stale"
        assert seen == {b for b in range(self.pool.num_blocks) if cached[b]}, "pool/tree disagree"
