"""Affinity keys: the label that decides where a request runs, so that work sharing cache lands
on one engine.

A request's key names what it shares with others, as precisely as the request tells:

* with an image: the image's canonical-pixel key (``vision.pixel_key``: every copy of one
  picture, PNG or lossless WebP, has one key), computed wherever the image is read;
* a chat request of several turns: every message before its last user turn (a shared system
  document and earlier turns, whatever their length; the new question does not count);
* a prompt whose shared part is named (a batch row's ``shared_prefix``): that part, whole;
* otherwise, when nothing tells, no key: the request is routed by its prompt's prefixes
  (``prefix_index.PrefixRoute``, read up to its first ``prefix_tokens`` token ids), to the
  replica that already holds the longest of them (``routing.rank_by_prefix``).

The cache salt is part of every key and route, so requests that may never share KV are never
grouped for sharing.
"""

from __future__ import annotations

import json
from typing import Any

import xxhash

from mmkv.distributed.prefix_index import RouteKey, prefix_route
from vision import ImageInput, load_image, pixel_key

DEFAULT_PREFIX_TOKENS = 256


def image_affinity(image: ImageInput, cache_salt: str | None = None, name: str = "image") -> str:
    """The key of a request about ``image``; ``vision.ImageError`` when it cannot be read."""
    return f"image:{_salt(cache_salt)}:{pixel_key(load_image(image, name)).hex()}"


def shared_prefix_affinity(shared_prefix: str, cache_salt: str | None = None) -> str:
    """The key of a prompt that names its shared part (the whole of it, however long)."""
    return _text(shared_prefix, cache_salt, kind="shared")


def chat_affinity(messages: list[dict[str, Any]], cache_salt: str | None = None) -> str | None:
    """The key of a chat request ending in a user turn: every message before that turn. None for
    a request of one turn, or one that does not end in a user turn (nothing tells what it shares)."""
    if len(messages) < 2 or messages[-1].get("role") != "user":
        return None
    earlier = json.dumps(messages[:-1], sort_keys=True, ensure_ascii=False, default=str)
    return _text(earlier, cache_salt, kind="chat")


def _text(shared: str, cache_salt: str | None, kind: str = "text") -> str:
    return f"{kind}:{_salt(cache_salt)}:{xxhash.xxh3_128_hexdigest(shared.encode())}"


def _salt(cache_salt: str | None) -> str:
    return xxhash.xxh3_64_hexdigest((cache_salt or "").encode())


def batch_line_key(text: str) -> RouteKey:
    """What places a line of a batch file (``--ray-replicas``): its first image's key, else the
    chat messages before its last user turn, else the route of its prompt's (or messages') first
    ``PREFIX_CHARS`` characters."""
    try:
        body = json.loads(text).get("body") or {}
        salt = body.get("cache_salt")
        messages = body.get("messages")
        if messages:
            for message in messages:
                for part in message.get("content") if isinstance(message.get("content"), list) else []:
                    if part.get("type") == "image_url":
                        return "image:" + str(part["image_url"]["url"])[-4096:]
            return chat_affinity(messages, salt) or prefix_route(json.dumps(messages), salt, PREFIX_CHARS)
        return prefix_route(str(body.get("prompt")), salt, PREFIX_CHARS)
    except (ValueError, AttributeError, TypeError, KeyError):
        return "unusable"  # the replica refuses the line, with the reason


PREFIX_CHARS = 1024  # the characters of a line's prompt that its route reads
