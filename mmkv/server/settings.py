"""What one server allows: its name, key, admission limit and caps (the safe defaults live here)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

from mmkv.server.media import MediaPolicy


@dataclass(slots=True)
class ServerSettings:
    """The HTTP front's rules. Defaults are the safe ones: bound to 127.0.0.1 with no key, so only
    requests addressed to it (``Host``: localhost, a loopback address, ``host`` or one of
    ``allowed_hosts``; see ``host_check``) are answered; no remote or local media, bodies up to
    16 MiB, 8 images a request, 256 sequences waiting beyond the batch, and no client-chosen
    priority. An ``api_key`` is never empty: ``ValueError`` at construction."""

    served_model_name: str
    api_key: str | None = None
    host: str = "127.0.0.1"  # the address bound to
    allowed_hosts: frozenset[str] = frozenset()  # more Host names answered without a key; "*": any
    max_waiting: int = 256  # sequences admitted beyond --max-num-seqs before 503
    max_body_bytes: int = 16 * 2**20
    max_images_per_request: int = 8
    retry_after_seconds: int = 1
    media: MediaPolicy = field(default_factory=MediaPolicy)
    client_priority: tuple[int, int] = (0, 0)  # the priorities a client may ask for (0: FCFS)
    stall_seconds: float = 60.0  # /health is 503 once one engine turn takes longer while work waits
    ui: bool = True  # the web page at GET /
    tool_call_parser: str | None = None  # hermes or llama3_json (None: the chat template's own format)

    def __post_init__(self) -> None:
        if self.api_key == "":
            raise ValueError("api_key is empty; give a key, or None for no key")


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    """The settings ``mmkv serve``'s flags describe; ``ValueError`` naming the option for an
    empty ``--api-key`` or ``MMKV_API_KEY`` (an empty key would leave the server open)."""
    media = MediaPolicy(allowed_local_path=args.allowed_local_media_path,
                        allowed_domains=frozenset(d.lower() for d in args.allowed_media_domains),
                        max_bytes=args.max_image_bytes, max_pixels=args.max_image_pixels,
                        timeout=args.media_timeout)
    return ServerSettings(served_model_name=args.served_model_name or Path(args.model).name,
                          api_key=api_key_from(args.api_key), host=args.host,
                          allowed_hosts=frozenset(args.allowed_hosts),
                          max_waiting=args.max_waiting,
                          max_body_bytes=args.max_body_bytes,
                          max_images_per_request=args.max_images_per_request, media=media,
                          client_priority=tuple(args.allow_client_priority or (0, 0)), ui=not args.no_ui,
                          tool_call_parser=args.tool_call_parser)


def api_key_from(option: str | None) -> str | None:
    """``--api-key``, else ``$MMKV_API_KEY``, else None; either given empty is a ``ValueError``."""
    if option == "":
        raise ValueError("--api-key is empty; give a key, or leave the option out for no key")
    if option is not None:
        return option
    env = os.environ.get("MMKV_API_KEY")
    if env == "":
        raise ValueError("MMKV_API_KEY is set but empty; give a key, or unset it for no key")
    return env
