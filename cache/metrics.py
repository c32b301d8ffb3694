"""Counters the cache keeps about itself."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(slots=True)
class CacheMetrics:
    """Monotonic counters; ``as_dict`` for reports."""

    hits: int = 0  # match_prefix calls that reused at least one token
    misses: int = 0  # match_prefix calls that reused nothing
    hit_tokens: int = 0  # tokens served from cache (full blocks plus copied partial-block slots)
    evictions: int = 0  # blocks evicted from the tree
    cow_copies: int = 0  # shared blocks copied before a write
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    compactions: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def reset(self) -> None:
        """Every counter back to 0 (shared with the radix tree, so reset in place)."""
        for name in self.__slots__:
            setattr(self, name, 0)
