"""Where batch rows run: one placement for every row of a job, whichever replica keyed it.

A row comes keyed (``rows.py``, ``affinity.batch_line_key``) by an affinity key (its image, its
named shared part, a chat's earlier turns) or by its prompt's ``PrefixRoute``. ``Placement.place``
puts a keyed row on the replica its key prefers by rendezvous hashing, and a prompt on the
replica holding the longest of its prefixes when that covers at least ``match_ratio`` of it, else
on the replica that was given fewest rows so far (``routing.rank_by_prefix``, no load guard:
batch rows are all queued at once). Guarantees: every row with one affinity key runs on one
replica; rows that share a prefix covering at least ``match_ratio`` of each (whole chunks), such
as a short report followed by each row's own question, run on the replica the first of them was
placed on, in whatever order and block they come, unless a row placed elsewhere shares more
than that prefix with one of them; placing is deterministic in the order rows arrive.
"""

from __future__ import annotations

from typing import Sequence

from mmkv.distributed.prefix_index import PrefixIndex, PrefixRoute, RouteKey
from mmkv.distributed.routing import MATCH_RATIO, rank_by_prefix, rendezvous_order

class Placement:
    """The replica of each row of a job over ``replicas`` (names); keeps what it placed."""

    def __init__(self, replicas: Sequence[str], match_ratio: float = MATCH_RATIO) -> None:
        self.replicas = list(replicas)
        self.match_ratio = match_ratio
        self.index = PrefixIndex()
        self.rows = dict.fromkeys(self.replicas, 0)

    def place(self, keys: Sequence[RouteKey]) -> list[int]:
        """Each row's replica, as an index into ``replicas``."""
        return [self.replicas.index(self._one(key)) for key in keys]

    def _one(self, key: RouteKey) -> str:
        if isinstance(key, PrefixRoute):
            ranked = rank_by_prefix(key, self.index, self.rows, float("inf"), match_ratio=self.match_ratio)
            replica = ranked[0]
            self.index.record(replica, key)
        else:
            replica = rendezvous_order(key, self.replicas)[0]
        self.rows[replica] += 1
        return replica
