"""Per-token cache keys and chained block hashes.

A sequence's key is an ``int64`` array of shape ``[num_tokens, 2]``: column 0 is the token id,
column 1 an extra tag that is 0 for plain text and ``image_id << 32 | offset`` for a token that
stands at ``offset`` inside the image whose confirmed identity is ``image_id`` (>= 1). Two tokens
share KV only when both columns are equal, so the same image at the same place shares and two
different images never do. Namespaces (cache salts) get separate roots in the tree, so tenants never
share either.

A block's key is the bytes of its ``block_size`` rows. Block hashes are chained: xxh3-64 of the
block's key seeded with the parent block's hash, the first block seeded by the namespace's hash.
Hashes only find candidates; the tree confirms every hit by comparing the key bytes.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
import xxhash

KEY_COLUMNS = 2
ROW_BYTES = KEY_COLUMNS * 8
IMAGE_OFFSET_BITS = 32


class ImageSpan(NamedTuple):
    """``length`` consecutive tokens from ``start`` that hold image ``image_id`` (>= 1)."""

    start: int
    length: int
    image_id: int


def make_keys(token_ids: Sequence[int] | np.ndarray, images: Sequence[ImageSpan] = ()) -> np.ndarray:
    """Build the ``[n, 2]`` key array for a token sequence with optional image spans."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    if tokens.ndim != 1:
        raise ValueError(f"token_ids must be one-dimensional, got shape {tokens.shape}")
    keys = np.zeros((tokens.shape[0], KEY_COLUMNS), dtype=np.int64)
    keys[:, 0] = tokens
    for span in images:
        if span.image_id < 1 or span.image_id >= 1 << 31:
            raise ValueError(f"image_id must be in [1, 2**31), got {span.image_id}")
        if span.start < 0 or span.length < 1 or span.start + span.length > tokens.shape[0]:
            raise ValueError(f"image span {span} does not fit a sequence of {tokens.shape[0]} tokens")
        offsets = np.arange(span.length, dtype=np.int64)
        keys[span.start:span.start + span.length, 1] = (span.image_id << IMAGE_OFFSET_BITS) | offsets
    return keys


def block_keys(keys: np.ndarray, block_size: int) -> list[bytes]:
    """Key bytes of each *full* block of ``keys``."""
    n = keys.shape[0] // block_size
    raw = np.ascontiguousarray(keys[: n * block_size]).tobytes()
    step = block_size * ROW_BYTES
    return [raw[i * step:(i + 1) * step] for i in range(n)]


def chain_hash(parent_hash: int, block_key: bytes) -> int:
    """Hash of a block given its parent's hash (xxh3-64 seeded with the parent)."""
    return xxhash.xxh3_64_intdigest(block_key, seed=parent_hash)


def namespace_hash(namespace: bytes) -> int:
    """Seed for the first block of a namespace."""
    return xxhash.xxh3_64_intdigest(b"mmkv-namespace:" + namespace)


def common_rows(a: bytes, b: bytes) -> int:
    """How many leading key rows two block keys share."""
    n = min(len(a), len(b)) // ROW_BYTES
    if a[: n * ROW_BYTES] == b[: n * ROW_BYTES]:
        return n
    x = np.frombuffer(a, dtype=np.int64, count=n * KEY_COLUMNS).reshape(n, KEY_COLUMNS)
    y = np.frombuffer(b, dtype=np.int64, count=n * KEY_COLUMNS).reshape(n, KEY_COLUMNS)
    return int(np.argmax((x != y).any(axis=1)))
