"""Content identity of preprocessed images.

The key of an image is xxh3-128 over the identity of the preprocessing and encoder and the
preprocessed tensors (names, shapes, dtypes and bytes). Each distinct image gets a small integer
``uid`` that the KV cache uses in its keys. A key hit is confirmed by comparing the stored tensors
themselves, so even a forced hash collision never gives two different images the same uid.

Uids are never reused: when an entry is dropped to respect the byte bound and the same picture comes
back later, it gets a new uid (its old KV then simply stops being found). That keeps the
no-false-sharing guarantee without tracking who still holds KV under an old uid.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch
import xxhash

Inputs = dict[str, torch.Tensor]


def image_key(inputs: Inputs, identity: str) -> bytes:
    """xxh3-128 of the preprocessing/encoder identity and the preprocessed tensors."""
    h = xxhash.xxh3_128(identity.encode())
    for name in sorted(inputs):
        t = inputs[name].detach().contiguous().cpu()
        h.update(f"|{name}|{tuple(t.shape)}|{t.dtype}|".encode())
        h.update(t.view(torch.uint8).numpy() if t.numel() else b"")  # hashed in place, no copy
    return h.digest()


def _nbytes(inputs: Inputs) -> int:
    return sum(t.numel() * t.element_size() for t in inputs.values())


def _same(a: Inputs, b: Inputs) -> bool:
    return a.keys() == b.keys() and all(
        a[k].shape == b[k].shape and a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


@dataclass(slots=True)
class _Entry:
    key: bytes
    uid: int
    inputs: Inputs


class ImageRegistry:
    """Maps preprocessed images to confirmed uids (>= 1), keeping at most ``max_bytes`` of them.
    Safe to call from several threads (a server prepares requests on worker threads): the key is
    computed outside the lock, the lookup and insertion under it."""

    def __init__(self, max_bytes: int = 256 << 20,
                 key_fn: Callable[[Inputs, str], bytes] = image_key) -> None:
        self.max_bytes = max_bytes
        self._key_fn = key_fn
        self._by_key: dict[bytes, list[_Entry]] = {}
        self._lru: OrderedDict[int, _Entry] = OrderedDict()
        self._bytes = 0
        self._next_uid = 1
        self._lock = threading.Lock()

    def identify(self, inputs: Inputs, identity: str) -> tuple[int, bytes]:
        """``(uid, key)`` of a preprocessed image; equal tensors give the same uid."""
        key = self._key_fn(inputs, identity)
        with self._lock:
            return self._confirm(key, inputs), key

    def _confirm(self, key: bytes, inputs: Inputs) -> int:
        for entry in self._by_key.get(key, ()):
            if _same(entry.inputs, inputs):
                self._lru.move_to_end(entry.uid)
                return entry.uid
        entry = _Entry(key, self._next_uid, {k: v.detach().clone() for k, v in inputs.items()})
        self._next_uid += 1
        self._by_key.setdefault(key, []).append(entry)
        self._lru[entry.uid] = entry
        self._bytes += _nbytes(entry.inputs)
        while self._bytes > self.max_bytes and len(self._lru) > 1:
            _, old = self._lru.popitem(last=False)
            self._by_key[old.key].remove(old)
            if not self._by_key[old.key]:
                del self._by_key[old.key]
            self._bytes -= _nbytes(old.inputs)
        return entry.uid

    def __len__(self) -> int:
        return len(self._lru)
