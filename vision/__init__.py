"""Images -> canonical pixels -> content identity -> embeddings (encoders and their cache).

The public names load on first use (PEP 562): reading and hashing images (``load_image``,
``pixel_key``) does not load torch and the encoders.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vision.embedding_cache import EmbeddingCache
    from vision.encoders import OpenClipEncoder, ProcessorEncoder, VisionEncoder, open_clip_vision_tower
    from vision.image_keys import ImageRegistry, image_key
    from vision.images import ImageError, ImageInput, load_image, pixel_key
    from vision.pipeline import PreparedImage, VisionPipeline

_HOMES = {"EmbeddingCache": "vision.embedding_cache", "ImageError": "vision.images",
          "ImageInput": "vision.images", "ImageRegistry": "vision.image_keys",
          "OpenClipEncoder": "vision.encoders", "PreparedImage": "vision.pipeline",
          "ProcessorEncoder": "vision.encoders", "VisionEncoder": "vision.encoders",
          "VisionPipeline": "vision.pipeline", "image_key": "vision.image_keys",
          "load_image": "vision.images", "open_clip_vision_tower": "vision.encoders",
          "pixel_key": "vision.images"}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:  # vision lies below mmkv, so it cannot use mmkv.lazy
    if name not in _HOMES:
        raise AttributeError(f"module 'vision' has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(_HOMES[name]), name)
    return value
