"""``mmkv serve [MODEL]``: flags, the engine, and uvicorn with a clean SIGTERM.

On SIGTERM (or Ctrl-C) the server stops accepting connections, aborts every request in flight
(streams end with an error event, waiting clients get 503), checks that the engine holds no block,
and exits; connections still open after ``--shutdown-timeout`` seconds are closed.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
from pathlib import Path

import uvicorn

from mmkv.engine import Engine
from mmkv.engine_args import add_engine_arguments, engine_from_args
from mmkv.server.app import build_app
from mmkv.server.async_engine import AsyncEngine
from mmkv.server.settings import ServerSettings, settings_from_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("MMKV_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route (default: $MMKV_API_KEY)")
    p.add_argument("--served-model-name", help="the model's name in the API (default: the directory name)")
    limits = p.add_argument_group("limits and media")
    limits.add_argument("--max-waiting", type=int, default=256,
                        help="requests admitted beyond --max-num-seqs; more get 503 + Retry-After")
    limits.add_argument("--max-body-bytes", type=int, default=16 * 2**20)
    limits.add_argument("--max-images-per-request", type=int, default=8)
    limits.add_argument("--max-image-bytes", type=int, default=10 * 2**20)
    limits.add_argument("--max-image-pixels", type=int, default=4096 * 4096)
    limits.add_argument("--media-timeout", type=float, default=5.0)
    limits.add_argument("--allowed-local-media-path", type=Path,
                        help="file:// image URLs only from under this directory (default: refused)")
    limits.add_argument("--allowed-media-domains", nargs="*", default=[],
                        help="hosts whose https:// images may be fetched (default: none)")
    scale = p.add_argument_group("scale out (Ray Serve; needs the ray extra)")
    scale.add_argument("--replicas", type=int, default=1,
                       help="engine replicas on Ray Serve behind a cache-aware router; 1: one process, no Ray")
    scale.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs each replica reserves")
    scale.add_argument("--ray-address", help="an existing Ray cluster (default: start a local one)")
    scale.add_argument("--affinity-prefix-tokens", type=int, default=256,
                       help="text requests sharing this many first tokens go to one replica")
    scale.add_argument("--route-imbalance-threshold", type=int, default=8,
                       help="route to the shortest queue once the longest exceeds it by this many requests")
    scale.add_argument("--route-imbalance-ratio", type=float, default=1.5,
                       help="... and by this factor")
    p.add_argument("--shutdown-timeout", type=float, default=5.0)
    p.add_argument("--log-level", default="warning")


class Server(uvicorn.Server):
    """uvicorn whose shutdown first aborts every request in flight, so that open streams end at
    once instead of holding the shutdown until they finish."""

    def __init__(self, config: uvicorn.Config, front: AsyncEngine) -> None:
        super().__init__(config)
        self.front = front

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.front.stop()
        await super().shutdown(sockets)


def build_server(engine: Engine, settings: ServerSettings, host: str = "127.0.0.1", port: int = 8000,
                 shutdown_timeout: float = 5.0, log_level: str = "warning") -> Server:
    front = AsyncEngine(engine, max_pending=engine.max_num_seqs + settings.max_waiting)
    config = uvicorn.Config(build_app(front, settings), host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=shutdown_timeout, access_log=False)
    return Server(config, front)


def run(args: argparse.Namespace) -> None:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s: %(message)s")
    if args.replicas < 1:
        raise SystemExit(f"--replicas must be >= 1, got {args.replicas}")
    if args.replicas > 1:
        from mmkv.distributed import serve_app  # Ray loads only for this

        serve_app.run(args)
        return
    settings = settings_from_args(args)
    server = build_server(engine_from_args(args), settings, args.host, args.port,
                          args.shutdown_timeout, args.log_level)
    print(f"mmkv serve: {settings.served_model_name} on http://{args.host}:{args.port}/v1", flush=True)
    server.run()
