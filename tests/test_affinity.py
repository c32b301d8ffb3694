"""Affinity keys (mmkv.distributed.affinity), without Ray: one picture has one key whatever its
file format, a one-pixel change or another cache salt gives another; a text key covers exactly
the first prefix tokens."""

import io

from PIL import Image

from mmkv.distributed.affinity import image_affinity, prefix_affinity
from tiny_vlms import picture


def encoded(image: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def test_one_picture_one_key_whatever_its_format():
    image = picture(3)
    png, webp = encoded(image, "PNG"), encoded(image, "WEBP", lossless=True)
    assert png != webp
    assert image_affinity(png) == image_affinity(webp) == image_affinity(image)
    changed = image.copy()
    changed.putpixel((0, 0), tuple(255 - c for c in image.getpixel((0, 0))))
    assert image_affinity(changed) != image_affinity(png)
    assert image_affinity(png, cache_salt="tenant-a") != image_affinity(png)


def test_a_text_key_covers_the_first_prefix_tokens_only():
    doc = list(range(100, 400))
    assert prefix_affinity(doc + [1, 2], 256) == prefix_affinity(doc + [3], 256)
    assert prefix_affinity(doc[:255] + [7], 256) != prefix_affinity(doc, 256)
    assert prefix_affinity(doc, 256, cache_salt="a") != prefix_affinity(doc, 256, cache_salt="b")
