"""Cache-aware ranking of replicas, free of Ray: by affinity key or by the longest prefix a replica
holds, with a load guard.

* A request with an affinity key (``affinity.py``: an image, a named shared part) prefers the
  replica with the highest rendezvous weight ``xxh3(key, replica)``, then the next highest, and
  so on: every request with one key prefers one replica, and adding or removing a replica moves
  only the keys that preferred it (``rank_replicas``).
* A request known only by its prompt (``prefix_index.PrefixRoute``) prefers the replica holding
  the longest of its prefixes, when that covers at least ``match_ratio`` of what the router read
  of it; else the least loaded replica, the one holding least on ties (``rank_by_prefix``, the
  rule of SGLang's cache-aware router). So rows sharing a prefix of at least ``match_ratio`` of
  their length, in whole chunks (a document before questions no longer than it), all go where
  the first of them went while the load is balanced, unless a prompt sent elsewhere shares more
  than that prefix with one of them.
* When the load is imbalanced (the longest queue exceeds the shortest by more than ``threshold``
  requests and by more than ``ratio`` times, as SGLang decides), both rank by queue length
  instead, so a burst on one key or one document spills onto idle replicas.
"""

from __future__ import annotations

from typing import Mapping

import xxhash

from mmkv.distributed.prefix_index import PrefixIndex, PrefixRoute

MATCH_RATIO = 0.5  # SGLang's default cache threshold


def rendezvous_order(key: str, replicas: list[str]) -> list[str]:
    """``replicas`` by descending rendezvous weight for ``key`` (ties impossible but broken by name)."""
    return sorted(replicas, key=lambda r: (-xxhash.xxh3_64_intdigest(f"{key}\x00{r}".encode()), r))


def imbalanced(queue_lens: Mapping[str, int], threshold: int, ratio: float = 1.5) -> bool:
    """SGLang's rule: ``max - min > threshold`` and ``max > ratio * min``."""
    if len(queue_lens) < 2:
        return False
    most, least = max(queue_lens.values()), min(queue_lens.values())
    return most - least > threshold and most > ratio * least


def rank_replicas(key: str | None, queue_lens: Mapping[str, int], threshold: int,
                  ratio: float = 1.5) -> list[str]:
    """Replica ids, most preferred first: by rendezvous weight for ``key`` while the load is
    balanced; by queue length (rendezvous order breaking ties) when it is not, or without a key."""
    order = rendezvous_order(key or "", list(queue_lens))
    if key is not None and not imbalanced(queue_lens, threshold, ratio):
        return order
    position = {r: i for i, r in enumerate(order)}
    return sorted(order, key=lambda r: (queue_lens[r], position[r]))


def rank_by_prefix(route: PrefixRoute, index: PrefixIndex, loads: Mapping[str, int], threshold: float,
                   ratio: float = 1.5, match_ratio: float = MATCH_RATIO) -> list[str]:
    """Replica ids, most preferred first, for a request known by its prompt: the replica of the
    longest prefix ``index`` holds when it covers at least ``match_ratio`` of ``route.length`` and
    the load is balanced, then the rest; otherwise all by ``loads``, then by what ``index``
    holds (least first), then by rendezvous weight of the route's first chunk."""
    order = rendezvous_order(str(route.keys[:1]), list(loads))
    position = {r: i for i, r in enumerate(order)}
    by_load = sorted(order, key=lambda r: (loads[r], index.size(r), position[r]))
    if imbalanced(loads, threshold, ratio):
        return by_load
    matched = index.matched(route, by_load)
    best = max(by_load, key=lambda r: matched[r])  # the least loaded of the longest
    if matched[best] > 0 and matched[best] >= match_ratio * route.length:
        return [best, *(r for r in by_load if r != best)]
    return by_load
