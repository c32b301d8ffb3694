"""From user images to confirmed identities and cached embeddings, for one model's encoder."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import torch

from vision.embedding_cache import EmbeddingCache
from vision.encoders import Inputs, VisionEncoder
from vision.image_keys import ImageRegistry
from vision.images import DEFAULT_MAX_PIXELS, ImageError, ImageInput, load_image


@dataclass(slots=True)
class PreparedImage:
    """A checked, preprocessed image with its confirmed ``uid`` and content ``key``."""

    uid: int
    key: bytes
    inputs: Inputs


class VisionPipeline:
    """Guarantees: the encoder runs at most once per distinct image while its embedding is cached
    or held; the same picture (whatever its file format) gets the same uid, a different one never
    does. Embeddings ``hold`` keeps are what ``embeddings`` returns for their uid, whatever the
    cache drops, until each hold is released."""

    def __init__(self, encoder: VisionEncoder, registry: ImageRegistry | None = None,
                 cache: EmbeddingCache | None = None, max_pixels: int = DEFAULT_MAX_PIXELS) -> None:
        self.encoder = encoder
        self.registry = registry if registry is not None else ImageRegistry()
        self.cache = cache if cache is not None else EmbeddingCache()
        self.max_pixels = max_pixels
        self._held: dict[int, tuple[torch.Tensor, int]] = {}  # uid -> (embeddings, holds)

    def prepare(self, items: Sequence[ImageInput], errors: Literal["raise", "return"] = "raise",
                label: str = "image") -> list[PreparedImage | ImageError]:
        """Decode, check and preprocess every item before anything else happens.

        With ``errors="raise"`` the first bad item raises ``ImageError``; with ``"return"`` it takes
        that item's place in the result. Errors name the item as ``"{label} {i}"``."""
        out: list[PreparedImage | ImageError] = []
        for i, item in enumerate(items):
            try:
                image = load_image(item, f"{label} {i}", self.max_pixels)
                inputs = self.encoder.preprocess(image)
            except ImageError as err:
                if errors == "raise":
                    raise
                out.append(err)
                continue
            uid, key = self.registry.identify(inputs, self.encoder.identity)
            out.append(PreparedImage(uid, key, inputs))
        return out

    def embeddings(self, image: PreparedImage) -> torch.Tensor:
        """The encoder output for ``image``: held, else cached, else encoded now."""
        held = self._held.get(image.uid)
        if held is not None:
            return held[0]
        cached = self.cache.get(image.uid)
        if cached is None:
            cached = self.encoder.encode(image.inputs)
            self.cache.put(image.uid, cached)
        return cached

    def hold(self, uid: int, value: torch.Tensor) -> None:
        """Keep ``value`` as ``uid``'s embeddings until ``release(uid)`` is called once more than
        before this call (a uid already held keeps its first value, which the encoder made from
        the same pixels)."""
        held, count = self._held.get(uid, (value, 0))
        self._held[uid] = (held, count + 1)

    def held(self, uid: int) -> torch.Tensor | None:
        entry = self._held.get(uid)
        return None if entry is None else entry[0]

    def release(self, uid: int) -> None:
        held, count = self._held[uid]
        if count == 1:
            del self._held[uid]
        else:
            self._held[uid] = (held, count - 1)

    @property
    def num_held(self) -> int:
        """Distinct uids whose embeddings are held."""
        return len(self._held)

    def stats(self) -> dict[str, int]:
        return {"encoder_calls": self.encoder.calls, "embedding_cache_hits": self.cache.hits,
                "embedding_cache_misses": self.cache.misses, "distinct_images": len(self.registry)}
