"""The HTTP app's front over engine replicas on Ray Serve: admission, the affinity key, streaming.

The ingress runs the same FastAPI app as ``mmkv serve`` (``mmkv.server.app``) over this front
instead of one ``AsyncEngine``. Each submission gets its affinity key here, where its images were
read and its prompt can be tokenized (``affinity.py``: the first image's pixel key, else every
chat message before the last user turn, else the ``PrefixRoute`` of the prompt's first
``prefix_tokens`` tokens), and goes to the replica that ``router.CacheAwareRouter`` picks, as one
streaming call.

Guarantees: a submission that ends early (client gone, error) cancels its call, and the replica's
``AsyncEngine`` aborts its requests; a replica's refusal (``ValueError``) or failure reaches the
app as the replica raised it; ``/health`` is healthy only when every replica reported a live
engine within ``STALE_S`` seconds.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, NamedTuple

from ray.exceptions import RayTaskError
from ray.serve.handle import DeploymentHandle

from mmkv import RequestOutput, SamplingParams
from mmkv.distributed.affinity import chat_affinity, image_affinity
from mmkv.distributed.prefix_index import RouteKey, prefix_route
from mmkv.preparer import longest_token, render_chat
from mmkv.server.async_engine import Admission, ChatPrompt, Ticket, Tokenized

STALE_S = 2.0  # a replica silent for this long (8 heartbeats) counts as down


class ReplicaInfo(NamedTuple):
    """What the ingress learns from a replica once: its tokenizer, its context length and how its
    weights are stored."""

    tokenizer: Any
    max_model_len: int
    quantization: str | None


class ReplicaSetFront:
    """``mmkv.server.app.Front`` over ``replicas`` engine replicas behind ``handle``; ``board``
    is the ``StatsBoard`` actor the replicas report to."""

    def __init__(self, handle: DeploymentHandle, board: Any, replicas: int, max_pending: int,
                 prefix_tokens: int) -> None:
        self.handle = handle
        self.board = board
        self.replicas = replicas
        self.admission = Admission(max_pending)
        self.prefix_tokens = prefix_tokens
        self.tokenizer: Any = None
        self.max_model_len = 0
        self.quantization: str | None = None
        self.prefix_chars = 0

    async def open(self) -> None:
        info: ReplicaInfo = await self.handle.describe.remote()
        self.tokenizer, self.max_model_len, self.quantization = info
        # a route reads a prompt's first tokens: these many characters always hold them
        self.prefix_chars = self.prefix_tokens * longest_token(self.tokenizer)

    async def close(self) -> None:
        """Nothing to stop here: each replica aborts its own requests when it shuts down."""

    def admit(self, n: int) -> Ticket:
        return self.admission.admit(n)

    async def generate(self, prompts: list[Any], params: SamplingParams, cache_salt: str | None = None,
                       stream: bool = True, strict_max_tokens: bool = False
                       ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """As ``AsyncEngine.generate``, on the replica the router picks for the first prompt's key."""
        key = await asyncio.to_thread(self.affinity, prompts[0], cache_salt)
        call = self.handle.options(stream=True).generate.remote(prompts, params, cache_salt, stream,
                                                                strict_max_tokens, affinity=key)
        try:
            async for item in call:
                yield item
        except RayTaskError as err:  # the replica's own exception, without Ray's wrapping
            raise err.cause from None
        finally:
            call.cancel()

    def affinity(self, prompt: Any, cache_salt: str | None) -> RouteKey | None:
        """The prompt's affinity key, else its route; None when neither can be computed here
        (the replica will then refuse the prompt with the reason). Runs on a worker thread, off
        the event loop that relays every replica's stream; text is tokenized only as far as the
        route reads it."""
        try:
            if isinstance(prompt, ChatPrompt) and prompt.images:
                return image_affinity(prompt.images[0], cache_salt)
            if isinstance(prompt, ChatPrompt):
                shared = chat_affinity(prompt.messages, cache_salt)
                if shared is not None:
                    return shared
                ids = render_chat(self.tokenizer, prompt.messages)
            elif isinstance(prompt, str):
                ids = self.tokenizer.encode(prompt[:self.prefix_chars])
            else:
                ids = prompt
            return prefix_route(list(ids), cache_salt, self.prefix_tokens)
        except ValueError:  # the replica refuses it, with the reason
            return None

    async def replica_stats(self) -> dict[str, dict[str, int]]:
        return await self.board.snapshot.remote(STALE_S)

    async def tokenize(self, prompt: Any, cache_salt: str | None = None) -> Tokenized:
        """As ``AsyncEngine.tokenize``, on the replica the router picks for the prompt's key: the
        one whose cache a request with this prompt would reach."""
        key = await asyncio.to_thread(self.affinity, prompt, cache_salt)
        try:
            return await self.handle.tokenize.remote(prompt, cache_salt, affinity=key)
        except RayTaskError as err:
            raise err.cause from None

    async def healthy(self) -> bool:
        live = await self.replica_stats()
        return len(live) >= self.replicas and all(s.get("engine_alive") for s in live.values())
