"""Which replica holds the longest start of a prompt: per replica, the prefixes of the prompts
routed to it, as SGLang's cache-aware router keeps an approximate radix tree per worker. It is a
record of where prompts were sent, not a view of any replica's cache; it decides where a request
goes, never what KV is reused (each engine's own radix tree decides that, by comparing tokens).

A prompt (token ids, or the characters of a text) is read up to its first ``limit`` elements and
cut into chunks of ``CHUNK``; the key of chunk ``i`` hashes the kind, the cache salt and chunks
``0..i``, so one key names one whole prefix (``PrefixRoute``), and prompts under different salts
never match. Guarantees of ``PrefixIndex``:

* ``matched(route)[r]`` is ``CHUNK`` times the number of leading chunks of ``route`` that some
  prompt recorded on ``r`` shares with it (barring 64-bit hash collisions, which can misroute
  a request and nothing else);
* a replica keeps at most ``max_keys`` keys; the least recently recorded go first, and a prefix
  never before a longer prefix recorded with it, so what a replica keeps is closed under taking
  prefixes and ``matched`` stays the longest prefix it keeps.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from typing import Iterable, NamedTuple, Sequence

import xxhash

CHUNK = 16  # elements per key: what a replica holds is matched in whole chunks


class PrefixRoute(NamedTuple):
    """A prompt as the router reads it: one key per whole chunk, and how many elements were read
    (a last partial chunk included)."""

    keys: tuple[int, ...]
    length: int


RouteKey = str | PrefixRoute  # what routes a request: an affinity key (``affinity.py``) or its route


def prefix_route(prompt: str | Sequence[int], cache_salt: str | None, limit: int) -> PrefixRoute:
    """The route of ``prompt``'s first ``limit`` elements (characters of a text, else token ids)."""
    read = prompt[:limit]
    kind = "text" if isinstance(read, str) else "tokens"
    key = xxhash.xxh3_64_intdigest(f"{kind}\x00{cache_salt or ''}".encode())
    keys = []
    for start in range(0, len(read) - CHUNK + 1, CHUNK):
        chunk = read[start:start + CHUNK]
        data = chunk.encode() if isinstance(chunk, str) else array("q", chunk).tobytes()
        key = xxhash.xxh3_64_intdigest(data, seed=key)
        keys.append(key)
    return PrefixRoute(tuple(keys), len(read))


class PrefixIndex:
    """The prefixes recorded on each replica (the module docstring states its guarantees)."""

    def __init__(self, max_keys: int = 1 << 20) -> None:
        if max_keys < 1:
            raise ValueError(f"max_keys must be >= 1, got {max_keys}")
        self.max_keys = max_keys
        self.kept: dict[str, OrderedDict[int, None]] = {}

    def matched(self, route: PrefixRoute, replicas: Iterable[str]) -> dict[str, int]:
        """Replica -> the elements of ``route``'s longest prefix recorded there."""
        out = {}
        for replica in replicas:
            kept, n = self.kept.get(replica, {}), 0
            while n < len(route.keys) and route.keys[n] in kept:
                n += 1
            out[replica] = n * CHUNK
        return out

    def record(self, replica: str, route: PrefixRoute) -> None:
        """Note that ``route`` was sent to ``replica``; drop its least recent keys past ``max_keys``."""
        kept = self.kept.setdefault(replica, OrderedDict())
        for key in reversed(route.keys):  # a prefix ends more recent than every longer one
            kept[key] = None
            kept.move_to_end(key)
        while len(kept) > self.max_keys:
            kept.popitem(last=False)

    def size(self, replica: str) -> int:
        """How many prefixes ``replica`` keeps (SGLang's size of its tree, in chunks)."""
        return len(self.kept.get(replica, ()))

    def forget(self, replica: str) -> None:
        """Drop everything recorded on ``replica`` (it is gone)."""
        self.kept.pop(replica, None)
