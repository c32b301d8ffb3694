"""Affinity keys: the label that decides where a request runs, so that work sharing cache lands
on one engine.

An image's key is its canonical-pixel key (``vision.pixel_key``: every copy of one picture, PNG or
lossless WebP, has one key), computed wherever the image is read; a text prompt's key is xxh3 of
its first ``prefix_tokens`` token ids. The cache salt is part of every key, so requests that may
never share KV are never grouped for sharing.
"""

from __future__ import annotations

from typing import Sequence

import xxhash

from vision import ImageInput, load_image, pixel_key

DEFAULT_PREFIX_TOKENS = 256


def image_affinity(image: ImageInput, cache_salt: str | None = None, name: str = "image") -> str:
    """The key of a request about ``image``; ``vision.ImageError`` when it cannot be read."""
    return f"image:{_salt(cache_salt)}:{pixel_key(load_image(image, name)).hex()}"


def prefix_affinity(token_ids: Sequence[int], prefix_tokens: int = DEFAULT_PREFIX_TOKENS,
                    cache_salt: str | None = None) -> str:
    """The key of a text request: a hash of its first ``prefix_tokens`` token ids."""
    head = ",".join(map(str, token_ids[:prefix_tokens])).encode()
    return f"text:{_salt(cache_salt)}:{xxhash.xxh3_128_hexdigest(head)}"


def _salt(cache_salt: str | None) -> str:
    return xxhash.xxh3_64_hexdigest((cache_salt or "").encode())
