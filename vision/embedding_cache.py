"""Encoder outputs by image uid, bounded in bytes, least recently used dropped first."""

from __future__ import annotations

from collections import OrderedDict

import torch


class EmbeddingCache:
    """Guarantees: never holds more than ``max_bytes`` (an entry larger than that is not kept);
    ``get`` returns exactly the tensor stored under the uid."""

    def __init__(self, max_bytes: int = 512 << 20) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0

    def get(self, uid: int) -> torch.Tensor | None:
        value = self._items.get(uid)
        if value is None:
            self.misses += 1
            return None
        self.hits += 1
        self._items.move_to_end(uid)
        return value

    def put(self, uid: int, value: torch.Tensor) -> None:
        size = value.numel() * value.element_size()
        if uid in self._items:
            old = self._items.pop(uid)
            self._bytes -= old.numel() * old.element_size()
        if size > self.max_bytes:
            return
        while self._bytes + size > self.max_bytes:
            _, dropped = self._items.popitem(last=False)
            self._bytes -= dropped.numel() * dropped.element_size()
        self._items[uid] = value
        self._bytes += size

    def resize(self, max_bytes: int) -> None:
        """Hold at most ``max_bytes`` from now on (0: keep nothing), least recently used dropped
        first."""
        self.max_bytes = max_bytes
        while self._bytes > max_bytes:
            _, dropped = self._items.popitem(last=False)
            self._bytes -= dropped.numel() * dropped.element_size()

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)
