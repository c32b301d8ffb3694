"""The radix tree against a naive reference: a dict of cached block-aligned prefixes.

The reference knows nothing of nodes, splits or hashes. It stores every cached prefix (a tuple of
block keys) with what each policy orders by, and evicts one block at a time: the unlocked prefix
that no other cached prefix extends and that the policy ranks lowest. The tree must agree on every
match, every insert, every eviction and every count. The pool (16 blocks) is small, so inserts run it full
and must evict first (as ``KVCache.allocate`` does), under every policy:

* ``lru``: the logical time a prefix was last matched or inserted;
* ``fifo``: the time it was first inserted;
* ``cost``: GreedyDual-Size-Frequency, ``credit = inflation + (1 + hits) * cost`` set whenever a
  prefix is matched or inserted; ``hits`` counts the matches that reused it, ``cost`` is the
  rebuild cost it was inserted with, and each eviction raises ``inflation`` to the evicted credit.
  Costs are pseudo-random per insert, so no two credits tie (the tree breaks ties by node age,
  which the reference does not model).
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cache import BlockPool, RadixTree, make_keys
from cache.keys import block_keys, common_rows

BS = 2
NUM_BLOCKS = 16
sequences = st.lists(st.integers(0, 4), min_size=0, max_size=14)
namespaces = st.sampled_from([b"", b"tenant"])


@dataclass(slots=True)
class Entry:
    created: int
    last_use: int
    cost: float
    hits: int = 0
    credit: float = 0.0


class Reference:
    def __init__(self, policy: str) -> None:
        self.policy = policy
        self.clock = 0
        self.inflation = 0.0
        self.cached: dict[tuple, Entry] = {}  # (namespace, block keys...) -> its entry
        self.locked: Counter[tuple] = Counter()

    def prefixes(self, ns: bytes, tokens: list[int]) -> list[tuple]:
        keys = block_keys(make_keys(tokens), BS)
        return [(ns, *keys[: i + 1]) for i in range(len(keys))]

    def _touch(self, entry: Entry, hit: bool) -> None:
        entry.last_use = self.clock
        entry.hits += hit
        entry.credit = self.inflation + (1 + entry.hits) * entry.cost

    def match(self, ns: bytes, tokens: list[int]) -> tuple[list[tuple], int]:
        self.clock += 1
        hit = []
        for p in self.prefixes(ns, tokens):
            if p not in self.cached:
                break
            hit.append(p)
        for p in hit:
            self._touch(self.cached[p], hit=True)
        start = len(hit) * BS
        tail = make_keys(tokens)[start:start + BS].tobytes()
        parent = hit[-1] if hit else (ns,)
        partial = max((common_rows(tail, p[-1]) for p in self.cached
                       if len(p) == len(parent) + 1 and p[:-1] == parent), default=0) if tail else 0
        return hit, partial

    def insert(self, ns: bytes, tokens: list[int], cost: float) -> int:
        self.clock += 1
        existing = 0
        for p in self.prefixes(ns, tokens):
            if p in self.cached:
                existing += 1
            else:
                self.cached[p] = Entry(created=self.clock, last_use=self.clock, cost=cost)
            self._touch(self.cached[p], hit=False)
        return existing

    def _rank(self, p: tuple) -> float:
        e = self.cached[p]
        return {"lru": e.last_use, "fifo": e.created, "cost": e.credit}[self.policy]

    def evictable(self) -> list[tuple]:
        extended = {p[:-1] for p in self.cached}
        return [p for p in self.cached if p not in extended and not self.locked[p]]

    def evict(self, n: int) -> int:
        done = 0
        while done < n and (leaves := self.evictable()):
            victim = min(leaves, key=self._rank)
            self.inflation = max(self.inflation, self.cached.pop(victim).credit)
            done += 1
        return done


class TreeMachine(RuleBasedStateMachine):
    policy = "lru"

    @initialize()
    def build(self):
        self.pool = BlockPool(NUM_BLOCKS)
        self.tree = RadixTree(self.pool, BS, policy=self.policy)
        self.ref = Reference(self.policy)
        self.locks: list[tuple[list[int], list[tuple]]] = []
        self.inserted: list[tuple[bytes, list[int]]] = []

    @rule(ns=namespaces, tokens=sequences)
    def insert(self, ns, tokens):
        """Allocate the blocks first, evicting what the pool lacks; insert what fits."""
        needed = len(tokens) // BS
        short = needed - self.pool.num_free
        if short > 0:
            event(f"insert evicted first under {self.ref.policy}")
            assert self.tree.evict(short) == self.ref.evict(short)
        tokens = tokens[: min(needed, self.pool.num_free) * BS]
        self.inserted.append((ns, tokens))
        cost = 1.0 + random.Random(len(self.inserted)).random() * 7  # no two sums of costs coincide
        blocks = self.pool.allocate(len(tokens) // BS)
        result = self.tree.insert(make_keys(tokens), blocks, ns, cost_per_block=cost)
        assert result.num_existing == self.ref.insert(ns, tokens, cost)
        self.tree.unlock(result.blocks)

    @rule(ns=namespaces, tokens=sequences, hold=st.booleans())
    def match(self, ns, tokens, hold):
        peeked = self.tree.cached_length(make_keys(tokens), ns)  # read-only: before the match
        m = self.tree.match_prefix(make_keys(tokens), ns)
        hit, partial = self.ref.match(ns, tokens)
        assert peeked == len(hit) * BS + partial
        assert m.num_tokens == len(hit) * BS == len(m.blocks) * BS
        assert m.partial_tokens == partial
        if hold:
            self.tree.lock(m.blocks)
            self.ref.locked.update(hit)
            self.locks.append((m.blocks, hit))

    @precondition(lambda self: self.inserted)
    @rule(data=st.data())
    def match_again(self, data):
        """Ask again for something inserted before: hits are what the cost policy counts."""
        ns, tokens = data.draw(st.sampled_from(self.inserted))
        self.match(ns, tokens, hold=False)

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        blocks, hit = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
        self.tree.unlock(blocks)
        self.ref.locked.subtract(hit)

    @rule(n=st.integers(1, 8))
    def evict(self, n):
        assert self.tree.evict(n) == self.ref.evict(n)

    @invariant()
    def same_cache_and_accounting(self):
        if not hasattr(self, "tree"):
            return
        got = set()
        for ns, root in self.tree._roots.items():
            stack = [(root, (ns,))]
            while stack:
                node, prefix = stack.pop()
                for key in node.keys:
                    prefix = (*prefix, key)
                    got.add(prefix)
                stack.extend((c, prefix) for c in node.child_nodes())
        assert got == set(self.ref.cached)
        in_use = {p for p, c in self.ref.locked.items() if c > 0}
        assert self.pool.num_in_use == len(in_use)
        assert self.pool.num_evictable == len(got) - len(in_use)
        assert self.pool.num_free == NUM_BLOCKS - len(got)
        self.tree.check_integrity()
        self.pool.check_integrity()


def machine_for(policy: str):
    machine = type(f"{policy.upper()}TreeMachine", (TreeMachine,), {"policy": policy})
    machine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
    return machine.TestCase


test_lru_tree_matches_reference = machine_for("lru")
test_fifo_tree_matches_reference = machine_for("fifo")
test_cost_tree_matches_reference = machine_for("cost")
