"""``mmkv serve --replicas N``: the OpenAI app as a Ray Serve ingress in front of N engine replicas.

Deployments: ``EngineReplica`` (one ``Engine`` behind an ``AsyncEngine`` each, ``N`` of them,
routed by ``CacheAwareRouter``) and ``OpenAIIngress`` (the FastAPI app of ``mmkv serve`` over a
``ReplicaSetFront``). A ``StatsBoard`` actor, owned by the process that builds the app, holds each
replica's latest stats, reported on a heartbeat; the ingress sums them for ``/metrics`` and reads
liveness from them for ``/health``.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from mmkv import SamplingParams
from mmkv.distributed.prefix_index import RouteKey
from mmkv.distributed.router import CacheAwareRouter
from mmkv.distributed.serve_front import ReplicaInfo, ReplicaSetFront
from mmkv.distributed.stats_board import StatsBoard
from mmkv.engine_args import engine_from_args
from mmkv.server.app import build_app
from mmkv.server.async_engine import AsyncEngine, Tokenized
from mmkv.server.settings import settings_from_args

HEARTBEAT_S = 0.25


class EngineReplica:
    """One engine serving Serve calls. Guarantees: a call that is cancelled or fails leaves none
    of its requests running; the replica reports its stats to the board every ``HEARTBEAT_S``
    and is reported unhealthy to Serve once its engine thread has ended."""

    def __init__(self, args: argparse.Namespace, board) -> None:
        engine = engine_from_args(args)
        self.front = AsyncEngine(engine, max_pending=engine.max_num_seqs + args.max_waiting)
        self.front.start()
        self.board = board
        self.name = serve.get_replica_context().replica_id.unique_id
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, name="mmkv-heartbeat", daemon=True)
        self._heartbeat.start()

    def _beat(self) -> None:
        while not self._stop.is_set():
            alive = int(self.front.running() and not self.front.stalled())
            ray.get(self.board.report.remote(self.name, {**self.front.stats, "engine_alive": alive}))
            self._stop.wait(HEARTBEAT_S)

    def describe(self) -> ReplicaInfo:
        engine = self.front.engine
        return ReplicaInfo(engine.tokenizer, engine.max_model_len, engine.quantization)

    async def generate(self, prompts: list, params: SamplingParams, cache_salt: str | None,
                       stream: bool, strict_max_tokens: bool = False, affinity: RouteKey | None = None):
        """``AsyncEngine.generate``'s items; ``affinity`` is read by the router only."""
        async for item in self.front.generate(prompts, params, cache_salt, stream, strict_max_tokens):
            yield item

    async def tokenize(self, prompt: Any, cache_salt: str | None,
                       affinity: RouteKey | None = None) -> Tokenized:
        """``AsyncEngine.tokenize``; ``affinity`` is read by the router only."""
        return await self.front.tokenize(prompt, cache_salt)

    def check_health(self) -> None:
        if not self.front.running():
            raise RuntimeError(f"replica {self.name}: the engine thread has ended")
        if self.front.stalled():
            raise RuntimeError(f"replica {self.name}: the engine thread is stuck in one step")

    def __del__(self) -> None:
        self._stop.set()
        self.front.stop()


@serve.ingress()
class OpenAIIngress:
    """The app of ``mmkv serve`` over the replicas (built once the front exists)."""

    async def __init__(self, replicas, board, args: argparse.Namespace) -> None:
        self.settings = settings_from_args(args)
        max_pending = args.replicas * (args.max_num_seqs + args.max_waiting)
        self.front = ReplicaSetFront(replicas, board, args.replicas, max_pending, args.affinity_prefix_tokens)

    def __serve_build_asgi_app__(self):
        return build_app(self.front, self.settings)


def build(args: argparse.Namespace) -> serve.Application:
    """The Serve application for ``args`` (``mmkv serve`` flags plus ``--replicas`` and routing)."""
    board = StatsBoard()
    router = RequestRouterConfig(request_router_class=CacheAwareRouter,
                                 request_router_kwargs={"threshold": args.route_imbalance_threshold,
                                                        "ratio": args.route_imbalance_ratio})
    replicas = serve.deployment(EngineReplica).options(
        num_replicas=args.replicas, ray_actor_options={"num_cpus": args.replica_cpus},
        max_ongoing_requests=args.max_num_seqs + args.max_waiting, request_router_config=router,
        health_check_period_s=2)
    ingress = serve.deployment(OpenAIIngress).options(
        num_replicas=1, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=args.replicas * (args.max_num_seqs + args.max_waiting))
    return ingress.bind(replicas.bind(args, board.actor), board.actor, args)


def run(args: argparse.Namespace) -> None:
    """Start (or join) a Ray cluster, deploy, and serve until interrupted."""
    ray.init(address=args.ray_address, include_dashboard=False)
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(build(args), name="mmkv", route_prefix="/")
    print(f"mmkv serve: {settings_from_args(args).served_model_name} on http://{args.host}:"
          f"{args.port}/v1 ({args.replicas} replicas on Ray Serve)", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
