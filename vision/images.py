"""Decoding and checking input images: PIL images, file paths or encoded bytes.

Every image becomes an RGB ``PIL.Image`` with its EXIF orientation applied (transparent pixels
are composited over white). Encoded bytes and files are decoded only as one of
``ACCEPTED_FORMATS`` (PNG, JPEG, WebP, GIF and BMP; of an animated GIF or WebP, the first frame):
PIL's other decoders never see untrusted data. A PIL image passed in is used as it is. Anything
that cannot be turned into a picture raises ``ImageError`` naming the item and the reason in words
(never a Python repr), before any model work starts. ``pixel_key`` names a canonical picture
by its pixels. This module loads neither torch nor an encoder, so a router can key images cheaply.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Union

import xxhash
from PIL import Image, ImageOps, UnidentifiedImageError

ImageInput = Union[Image.Image, str, Path, bytes, bytearray]

DEFAULT_MAX_PIXELS = 40_000_000
ACCEPTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # PIL's names for the decoders allowed
ACCEPTED_FORMATS_TEXT = "PNG, JPEG, WebP, GIF, BMP"
CONVERTIBLE_MODES = {"1", "L", "LA", "P", "PA", "RGB", "RGBA", "RGBX", "RGBa", "CMYK", "YCbCr",
                     "LAB", "HSV", "La"}


class ImageError(ValueError):
    """An input image that cannot be used; the message names the item and why."""

    def __init__(self, item: str, reason: str) -> None:
        super().__init__(f"{item}: {reason}")
        self.item = item
        self.reason = reason


def load_image(item: ImageInput, name: str = "image", max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """The canonical RGB picture of ``item`` (see the module docstring); errors say ``name``."""
    image = _open(item, name)
    width, height = image.size
    if width == 0 or height == 0:
        raise ImageError(name, f"has zero size ({width}x{height})")
    if width * height > max_pixels:  # checked on the header, before decoding any pixel
        raise ImageError(name, f"has {width * height} pixels, over the limit of {max_pixels}")
    if image.mode not in CONVERTIBLE_MODES:
        raise ImageError(name, f"has unsupported mode {image.mode!r}; "
                                f"supported: {', '.join(sorted(CONVERTIBLE_MODES))}")
    try:
        image.load()
        image = ImageOps.exif_transpose(image)
    except (OSError, ValueError, Image.DecompressionBombError) as err:
        raise ImageError(name, f"cannot be decoded: {err}") from err
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def _open(item: ImageInput, name: str) -> Image.Image:
    if isinstance(item, Image.Image):
        return item
    if isinstance(item, (bytes, bytearray)):
        if not item:
            raise ImageError(name, "is empty (0 bytes)")
        source = io.BytesIO(bytes(item))
    elif isinstance(item, (str, Path)):
        path = Path(item)
        if not path.is_file():
            raise ImageError(name, f"file {str(item)!r} does not exist")
        source = path
    else:
        raise ImageError(name, f"must be a PIL image, a path or bytes, got {type(item).__name__}")
    try:
        return Image.open(source, formats=ACCEPTED_FORMATS)
    except Image.DecompressionBombError as err:
        raise ImageError(name, f"cannot be decoded: {err}") from err
    except UnidentifiedImageError:  # its message holds a repr of the stream: not shown
        raise ImageError(name, f"cannot be decoded: not a readable image (accepted formats: "
                               f"{ACCEPTED_FORMATS_TEXT})") from None
    except OSError as err:
        if err.errno is not None:  # the file itself could not be read
            raise ImageError(name, f"file {str(item)!r} cannot be read: {err.strerror}") from None
        raise ImageError(name, f"cannot be decoded: {err}") from err


def pixel_key(image: Image.Image) -> bytes:
    """xxh3-128 of a canonical picture (``load_image``'s RGB output): its size and pixels.

    Equal pixel keys mean equal preprocessed tensors, hence the same ``image_key`` for any
    encoder, so a router that sends equal pixel keys to one place sends every copy of an image
    there, without loading the model's processor."""
    h = xxhash.xxh3_128(f"{image.mode}|{image.size[0]}x{image.size[1]}|".encode())
    h.update(image.tobytes())
    return h.digest()
