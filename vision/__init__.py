"""Images -> canonical pixels -> content identity -> embeddings (encoders and their cache)."""

from vision.embedding_cache import EmbeddingCache
from vision.encoders import OpenClipEncoder, ProcessorEncoder, VisionEncoder, open_clip_vision_tower
from vision.image_keys import ImageRegistry, image_key, pixel_key
from vision.images import ImageError, ImageInput, load_image
from vision.pipeline import PreparedImage, VisionPipeline

__all__ = [
    "EmbeddingCache", "ImageError", "ImageInput", "ImageRegistry", "OpenClipEncoder",
    "PreparedImage", "ProcessorEncoder", "VisionEncoder", "VisionPipeline", "image_key",
    "load_image", "open_clip_vision_tower", "pixel_key",
]
