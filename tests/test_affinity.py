"""Affinity keys (mmkv.distributed.affinity), without Ray: one picture has one key whatever its
file format, a one-pixel change or another cache salt gives another; a text key covers exactly
the first prefix tokens; a named shared prefix and a chat's earlier turns are keyed whole, the
last user turn never."""

import io

from PIL import Image

from mmkv.distributed.affinity import (chat_affinity, image_affinity, prefix_affinity,
                                       shared_prefix_affinity)
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


def test_a_shared_prefix_is_keyed_whole_whatever_its_length():
    doc = "report on vale. " + "the river is wide. " * 500
    assert shared_prefix_affinity(doc) == shared_prefix_affinity(doc)
    assert shared_prefix_affinity(doc + "x") != shared_prefix_affinity(doc)  # the end counts too
    assert shared_prefix_affinity(doc, cache_salt="a") != shared_prefix_affinity(doc)


def test_a_chat_is_keyed_by_every_message_before_its_last_user_turn():
    system = {"role": "system", "content": "report on vale. population 3,000."}
    ask = lambda q: {"role": "user", "content": q}  # noqa: E731
    assert chat_affinity([system, ask("who is the mayor?")]) == chat_affinity([system, ask("when?")])
    other = {"role": "system", "content": "report on dale. population 3,000."}
    assert chat_affinity([other, ask("when?")]) != chat_affinity([system, ask("when?")])
    turns = [system, ask("when?"), {"role": "assistant", "content": "founded 1200."}]
    assert chat_affinity(turns + [ask("who?")]) != chat_affinity([system, ask("who?")])
    assert chat_affinity([system, ask("q")], cache_salt="a") != chat_affinity([system, ask("q")])
    # nothing tells what a single turn, or a request ending in another role, shares
    assert chat_affinity([ask("who is the mayor?")]) is None
    assert chat_affinity(turns) is None
