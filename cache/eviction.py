"""Eviction policies: which unreferenced leaf of the radix tree gives up its blocks first.

Each policy maps a node to a sort key; the tree evicts the node with the *smallest* key first,
taking blocks from the tail of that node's edge so the tree stays prefix-closed.

* ``lru``: least recently matched or inserted first (``last_access``).
* ``fifo``: oldest insertion first (``created``).
* ``cost``: GreedyDual-Size-Frequency. Each node carries a credit set when it is inserted or hit::

      credit = inflation + (1 + hits) * cost_per_block

  where ``cost_per_block`` is the compute needed to rebuild one block (``block_size × num_layers``
  token-layers unless the caller supplies its own figure) and ``hits`` counts matches that reused
  the node. The node with the lowest credit is evicted and ``inflation`` rises to that credit, so a
  node that is not used again sinks below newly touched ones (recency), a node hit often stays
  longer (frequency), and an expensive node outlives a cheap one of the same age (cost).
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from cache.radix_tree import Node


class EvictionPolicy(ABC):
    """Orders evictable leaves. Keys must be comparable; smallest is evicted first."""

    name: str

    def touch(self, node: "Node") -> None:
        """Called after ``node`` was inserted or hit (its ``hits``/``last_access`` are updated)."""

    def evicted(self, node: "Node") -> None:
        """Called when blocks of ``node`` are evicted."""

    @abstractmethod
    def key(self, node: "Node") -> float:
        ...


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def key(self, node: "Node") -> float:
        return node.last_access


class FIFOPolicy(EvictionPolicy):
    name = "fifo"

    def key(self, node: "Node") -> float:
        return node.created


class CostPolicy(EvictionPolicy):
    name = "cost"

    def __init__(self) -> None:
        self.inflation = 0.0

    def touch(self, node: "Node") -> None:
        node.credit = self.inflation + (1 + node.hits) * node.cost_per_block

    def evicted(self, node: "Node") -> None:
        self.inflation = max(self.inflation, node.credit)

    def key(self, node: "Node") -> float:
        return node.credit


POLICIES: dict[str, type[EvictionPolicy]] = {p.name: p for p in (LRUPolicy, FIFOPolicy, CostPolicy)}


class EvictionQueue:
    """The radix tree's evictable leaves, popped in ``policy`` order.

    Membership is exact (a set); the order is a lazy heap whose entries go stale when a member is
    touched or leaves the set, and are skipped on ``pop``. The heap is rebuilt from the members
    when stale entries outnumber them, so it stays within twice the members plus a constant."""

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        self._members: set["Node"] = set()
        self._heap: list[tuple[float, int, "Node"]] = []

    def __contains__(self, node: "Node") -> bool:
        return node in self._members

    def __iter__(self) -> Iterator["Node"]:
        return iter(self._members)

    def add(self, node: "Node") -> None:
        if node not in self._members:
            self._members.add(node)
            self._push(node)

    def discard(self, node: "Node") -> None:
        self._members.discard(node)

    def touched(self, node: "Node") -> None:
        """``node``'s key may have changed: a member is queued again under its new key."""
        if node in self._members:
            self._push(node)

    def pop(self) -> "Node | None":
        """The member with the smallest key, left in the set (None when there is none); a caller
        that keeps it evictable after taking some of its blocks calls ``touched``."""
        key, heap = self.policy.key, self._heap
        while heap:
            priority, _, node = heapq.heappop(heap)
            if node in self._members and priority == key(node):
                return node
        return None

    def _push(self, node: "Node") -> None:
        heap = self._heap
        if len(heap) > 2 * len(self._members) + 64:
            heap[:] = [(self.policy.key(n), n.uid, n) for n in self._members if n is not node]
            heapq.heapify(heap)
        heapq.heappush(heap, (self.policy.key(node), node.uid, node))


def make_policy(name: str) -> EvictionPolicy:
    """Policy by name: ``lru`` (default), ``fifo`` or ``cost``."""
    if name not in POLICIES:
        raise ValueError(f"eviction policy must be one of {sorted(POLICIES)}, got {name!r}")
    return POLICIES[name]()
