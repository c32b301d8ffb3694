"""The engine's unfinished requests: each request's sequences, one per sample."""

from __future__ import annotations

import itertools

from mmkv.sequence import Sequence, Status


class RequestTable:
    """Every request from submission until its output is finished or it is aborted.

    Request ids and forked samples' sequence ids come from one counter (a request's first
    sequence has the request's id); arrival numbers from another, in submission order.

    Invariant: a request is here exactly while it has a sequence that is not finished, or a
    finished output nobody has collected yet; an engine with nothing to run holds none."""

    def __init__(self) -> None:
        self._families: dict[int, list[Sequence]] = {}
        self._ids = itertools.count()
        self._arrivals = itertools.count()

    def __bool__(self) -> bool:
        return bool(self._families)

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._families

    def ids(self) -> list[int]:
        return sorted(self._families)

    def new_id(self) -> int:
        return next(self._ids)

    def new_arrival(self) -> int:
        return next(self._arrivals)

    def add(self, seq: Sequence) -> None:
        """A request's first sequence, or a sample forked from it."""
        self._families.setdefault(seq.request_id, []).append(seq)

    def family(self, request_id: int) -> list[Sequence]:
        """The request's sequences, in the order they joined (its first one first)."""
        return self._families[request_id]

    def pop(self, request_id: int) -> list[Sequence] | None:
        return self._families.pop(request_id, None)

    def unfinished(self) -> list[Sequence]:
        """Every sequence that is not finished (running, waiting or swapped out)."""
        return [s for family in self._families.values() for s in family
                if s.status is not Status.FINISHED]

    def remap_tables(self, mapping: dict[int, int]) -> None:
        """Every unfinished sequence's tables follow blocks that moved (``KVCache.resize``)."""
        for seq in self.unfinished():
            for table in (seq.table, seq.swapped, *seq.image_tables):
                if table is not None:
                    table.remap(mapping)
