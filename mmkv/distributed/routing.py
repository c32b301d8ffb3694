"""Cache-aware ranking of replicas, free of Ray: rendezvous hashing with a load guard.

Every request with one affinity key prefers the same replica, the one with the highest
rendezvous weight ``xxh3(key, replica)``, then the next highest, and so on; adding or removing a
replica moves only the keys that preferred it. When the load is imbalanced (the longest queue
exceeds the shortest by more than ``threshold`` requests and by more than ``ratio`` times, as
SGLang's cache-aware router decides), replicas are ranked by queue length instead, so a burst on
one key spills onto idle replicas.
"""

from __future__ import annotations

from typing import Mapping

import xxhash


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
