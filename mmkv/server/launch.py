"""``mmkv serve [MODEL]`` (its flags: ``mmkv.cli``): the engine, and uvicorn with a clean SIGTERM.

Bad settings (an empty ``--api-key``) end the start with a message naming the option, before
the model loads; binding to a non-loopback address without a key logs a warning. The start is
logged at INFO: the model, its dtype, the KV pool in blocks and bytes, the attention backend,
then the address, and ``ready`` once the socket is bound and the engine's thread runs.
On SIGTERM (or Ctrl-C) the server stops accepting connections, aborts every request in flight
(streams end with an error event, waiting clients get 503), checks that the engine holds no block,
and exits; connections still open after ``--shutdown-timeout`` seconds are closed.
"""

from __future__ import annotations

import argparse
import logging
import socket

import uvicorn

from mmkv.engine import Engine
from mmkv.engine_args import engine_from_args
from mmkv.server.app import build_app
from mmkv.server.async_engine import AsyncEngine
from mmkv.server.host_check import exposure_warning
from mmkv.server.settings import ServerSettings, settings_from_args

log = logging.getLogger("mmkv.server")


class Server(uvicorn.Server):
    """uvicorn whose shutdown first aborts every request in flight, so that open streams end at
    once instead of holding the shutdown until they finish."""

    def __init__(self, config: uvicorn.Config, front: AsyncEngine) -> None:
        super().__init__(config)
        self.front = front

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            log.info("ready")

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.front.stop()
        await super().shutdown(sockets)


def build_server(engine: Engine, settings: ServerSettings, port: int = 8000,
                 shutdown_timeout: float = 5.0, log_level: str = "warning") -> Server:
    """The server for ``engine``, to listen on ``settings.host`` and ``port``."""
    front = AsyncEngine(engine, max_pending=engine.max_num_seqs + settings.max_waiting,
                        stall_seconds=settings.stall_seconds)
    config = uvicorn.Config(build_app(front, settings), host=settings.host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=shutdown_timeout, access_log=False)
    return Server(config, front)


def run(args: argparse.Namespace) -> None:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s: %(message)s")
    try:
        settings = settings_from_args(args)
    except ValueError as err:
        raise SystemExit(f"mmkv serve: {err}") from None
    warning = exposure_warning(settings.host, settings.api_key)
    if warning is not None:
        log.warning(warning)
    if args.replicas < 1:
        raise SystemExit(f"--replicas must be >= 1, got {args.replicas}")
    if args.replicas > 1:
        from mmkv.distributed import serve_app  # Ray loads only for this

        serve_app.run(args)
        return
    log.info("loading %s", args.model)
    engine = engine_from_args(args)
    log_engine(engine)
    server = build_server(engine, settings, args.port, args.shutdown_timeout, args.log_level)
    log.info("serving %s on http://%s:%d/v1", settings.served_model_name, args.host, args.port)
    server.run()


def log_engine(engine: Engine) -> None:
    """What a user wants to know of the engine once it is built."""
    kv, model = engine.kv, engine.model
    log.info("model: %s, %s on %s, %d layers, max_model_len %d", type(model.model).__name__,
             str(model.dtype).removeprefix("torch."), model.device, model.num_layers,
             engine.max_model_len)
    log.info("KV pool: %d blocks of %d tokens, %.1f MiB (host tier: %d blocks); attention: %s",
             kv.pool.num_blocks, kv.block_size, kv.pool.num_blocks * kv.bytes_per_block / 2**20,
             kv.host_pool.num_blocks if kv.host_pool is not None else 0, engine.attention.name)
