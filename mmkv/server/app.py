"""The OpenAI-compatible HTTP API (FastAPI) over a ``Front``: one ``AsyncEngine``, or engine
replicas on Ray Serve (``mmkv.distributed``).

A generation request is checked in this order, so refusals cost nothing: API key (401), or
without a key its ``Host`` (403; ``host_check``), body size (413), JSON and fields (400; parsed on a
worker thread, so a large body never holds the event loop), model name (404), admission limit
(503 with ``Retry-After``, counted in sequences: prompts times ``n``; 400 for a request that could
never be admitted); only then are its images loaded, all at once (400 naming a refused one), and
is it prepared off the engine thread and submitted (400 when the engine refuses the prompt, or
when an explicit ``max_tokens`` cannot follow it within ``max_model_len``). From then on a client
that disconnects, streaming or not, has its requests aborted (its image loads cancelled): their
blocks are free before the engine's next step, its admission places free at once.

``/tokenize`` and ``/detokenize`` take the same path with one sequence's admission place, held
until they answer: the same checks and limits, the same image rules, the same 400s, and the same
end for a client that leaves (its work cancelled, its place released).

``/health`` needs no API key (nor an allowed ``Host``) and no engine work: 200 while the engine
is alive and not stalled. Every request leaves one access-log line (status, tokens, latency).
"""

from __future__ import annotations

import asyncio
import copy
import hmac
import logging
import time
from pathlib import Path
from contextlib import asynccontextmanager, suppress
from typing import Any, AsyncIterator, Awaitable, Callable, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from mmkv import RequestOutput, SamplingParams
from mmkv.server.async_engine import (Admission, ChatPrompt, EngineOverloaded, EngineStopped,
                                      RequestFailed, Ticket, Tokenized)
from mmkv.server.host_check import HostAllowList, RequireHost
from mmkv.server.media import MediaLoader
from mmkv.server.metrics import ServerMetrics
from mmkv.server.protocol import (ApiError, ChatCompletionRequest, CompletionRequest,
                                  DetokenizeRequest, TokenizeRequest, parse, template_messages)
from mmkv.server.responses import (ChoiceStream, Header, Reply, chat_chunk, chat_completion, chat_logprobs,
                                   chat_message, completion, completion_chunk, completion_logprobs,
                                   echo_texts, echoed_logprobs, plain_reply, sse, usage,
                                   vllm_prompt_logprobs)
from mmkv.server.tool_calls import parser_for
from mmkv.server.settings import ServerSettings

UI_PAGE = Path(__file__).with_name("ui.html")
log = logging.getLogger("mmkv.server")
access_log = logging.getLogger("mmkv.server.access")


class _ClientGone(Exception):
    """The client disconnected before its answer was ready."""


class Front(Protocol):
    """What the app runs requests on: one engine (``AsyncEngine``) or a set of engine replicas
    (``mmkv.distributed.serve_front.ReplicaSetFront``). ``tokenizer`` and ``max_model_len`` are
    valid once ``open`` has returned, as is ``quantization`` (how the weights are stored:
    ``int4 (group 32)``, ``gguf Q4_K_M``; None for the checkpoint's own floats)."""

    tokenizer: Any
    max_model_len: int
    quantization: str | None
    admission: Admission

    async def open(self) -> None: ...
    async def close(self) -> None: ...
    def admit(self, n: int) -> Ticket: ...
    def generate(self, prompts: list[Any], params: SamplingParams, cache_salt: str | None = None,
                 stream: bool = True, strict_max_tokens: bool = False
                 ) -> AsyncIterator[tuple[int, RequestOutput]]: ...
    async def healthy(self) -> bool: ...
    async def replica_stats(self) -> dict[str, dict[str, int]]: ...
    async def tokenize(self, prompt: Any, cache_salt: str | None = None) -> Tokenized: ...


class _TokenText:
    """Token id -> its text, on a copy of the front's tokenizer (off the engine thread)."""

    def __init__(self) -> None:
        self.tokenizer: Any = None

    def __call__(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)


def build_app(front: Front, settings: ServerSettings, media: MediaLoader | None = None) -> FastAPI:
    """The app; its lifespan opens the front (starts the engine thread) and, on shutdown, closes
    it (aborts what runs and stops it)."""
    media = media if media is not None else MediaLoader(settings.media)
    metrics = ServerMetrics()
    token_text = _TokenText()

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await front.open()
        token_text.tokenizer = copy.deepcopy(front.tokenizer)
        yield
        await front.close()
        stats = await front.replica_stats()
        log.warning("mmkv serve stopped: %d KV blocks in use, block accounting checked",
                    sum(s.get("blocks_in_use", 0) for s in stats.values()))

    app = FastAPI(lifespan=lifespan, title="mmkv", docs_url=None, redoc_url=None, openapi_url=None)
    if settings.api_key:
        app.add_middleware(_RequireKey, key=settings.api_key, open_paths={"/health", "/"} if settings.ui
                           else {"/health"})
    else:
        app.add_middleware(RequireHost, allow=HostAllowList.of(settings.host, settings.allowed_hosts))
    app.add_middleware(_AccessLog)  # the outermost: refusals by key or Host are logged too
    app.add_exception_handler(_ClientGone, _client_gone)
    app.add_exception_handler(ApiError, _error_response)
    app.add_exception_handler(HTTPException, _error_response)
    app.add_exception_handler(Exception, _error_response)

    if settings.ui:
        page = UI_PAGE.read_text().replace("__MAX_IMAGE_BYTES__", str(settings.media.max_bytes))

        @app.get("/")
        async def web_page() -> Response:
            """The web page (``mmkv/server/ui.html``): one file, no build step, no CDN; it asks for
            the API key itself, so it is served without one and reveals nothing else."""
            return Response(page, media_type="text/html; charset=utf-8")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if await front.healthy() else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(await front.replica_stats()), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/stats")
    async def stats() -> dict[str, Any]:
        """Every replica's ``Engine.stats()`` (one replica: ``engine``), behind the API key."""
        return {"replicas": await front.replica_stats()}

    def model_card() -> dict[str, Any]:
        return {"id": settings.served_model_name, "object": "model", "created": 0,
                "owned_by": "mmkv", "max_model_len": front.max_model_len,
                "quantization": front.quantization}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        _check_model(model, settings)
        return model_card()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await _parse(ChatCompletionRequest, request, settings)
        params = req.params(front.max_model_len)
        messages, urls = _chat_messages(req.messages, settings)
        reply = req.reply(parser_for(token_text.tokenizer, settings.tool_call_parser))
        ticket = _admit(front, params.n, settings)
        images = await _while_held(request, ticket, media.load_all(urls), "messages")
        return await respond(request, ticket, [ChatPrompt(messages, images, req.tool_definitions())], params, req,
                             Header("chat", req.model), strict=req.explicit_max_tokens is not None,
                             reply=reply)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        """vLLM's shape: ``{"prompt": text}`` or ``{"messages": [...]}`` (images as chat parts) ->
        ``tokens``, ``count``, ``max_model_len``, each image's span, and ``cached_tokens``: how
        many leading tokens the cache would serve a request with this prompt now."""
        req = await _parse(TokenizeRequest, request, settings)
        chat = req.messages is not None
        messages, urls = _chat_messages(req.messages, settings) if chat else ([], [])

        async def tokens() -> Tokenized:
            images = await media.load_all(urls)
            return await front.tokenize(ChatPrompt(messages, images) if chat else req.prompt, req.cache_salt)

        done = await answer_briefly(request, tokens, "messages" if chat else "prompt")
        return {"tokens": done.token_ids, "count": len(done.token_ids), "max_model_len": front.max_model_len,
                "images": [{"start": start, "length": length} for start, length in done.images],
                "cached_tokens": done.cached_tokens}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req = await _parse(DetokenizeRequest, request, settings)
        text = await answer_briefly(
            request, lambda: asyncio.to_thread(_decode, token_text.tokenizer, req.tokens), "tokens")
        return {"prompt": text}

    async def answer_briefly(request: Request, work: Callable[[], Awaitable], param: str) -> Any:
        """``work()``'s result, run under one sequence's admission place, released when it ends."""
        ticket = _admit(front, 1, settings)
        try:
            return await _while_held(request, ticket, work(), param)
        finally:
            ticket.release()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await _parse(CompletionRequest, request, settings)
        prompts = req.prompts()
        params = req.params()
        ticket = _admit(front, len(prompts) * params.n, settings)
        return await respond(request, ticket, prompts, params, req, Header("completion", req.model),
                             strict="max_tokens" in req.model_fields_set)

    async def respond(request: Request, ticket: Ticket, prompts: list, params: SamplingParams,
                      req: ChatCompletionRequest | CompletionRequest, header: Header,
                      strict: bool, reply: Reply = plain_reply) -> Response:
        arrival = time.perf_counter()
        outputs = front.generate(prompts, params, req.cache_salt, stream=req.stream,
                                 strict_max_tokens=strict)
        timer = _Timer(metrics, arrival)
        try:
            if not req.stream:
                finals = await _unless_disconnected(request, _collect(outputs, len(prompts), timer))
                ticket.release()
                timer.done()
                request.state.usage = usage(finals)
                if header.kind == "chat":
                    return JSONResponse(chat_completion(header, finals[0], token_text, reply))
                echo = echo_texts(prompts, finals, token_text.decode) if req.echo else None
                return JSONResponse(completion(header, finals, token_text, echo, req.logprobs is not None,
                                               req.prompt_logprobs is not None))
            first = await _unless_disconnected(request, anext(outputs))
        except BaseException as err:
            ticket.release()
            await outputs.aclose()
            raise _api_error(err) from None
        events = _events(header, first, outputs, prompts, params, req, token_text, timer, request.state, reply)
        return _EventStream(events, ticket)

    return app


class _Timer:
    """Observes a request's time to first token and its latency, once each."""

    def __init__(self, metrics: ServerMetrics, arrival: float) -> None:
        self.metrics, self.arrival, self.first_seen = metrics, arrival, False

    def saw(self, out: RequestOutput) -> None:
        if not self.first_seen and any(c.token_ids for c in out.outputs):
            self.first_seen = True
            self.metrics.time_to_first_token.observe(time.perf_counter() - self.arrival)

    def done(self) -> None:
        self.metrics.request_latency.observe(time.perf_counter() - self.arrival)


async def _collect(outputs: AsyncIterator[tuple[int, RequestOutput]], n: int,
                   timer: _Timer) -> list[RequestOutput]:
    finals: list[RequestOutput] = [None] * n  # type: ignore[list-item]
    async for index, out in outputs:
        timer.saw(out)
        if out.finished:
            finals[index] = out
    return finals


async def _events(header: Header, first: tuple[int, RequestOutput],
                  outputs: AsyncIterator[tuple[int, RequestOutput]], prompts: list,
                  params: SamplingParams, req: ChatCompletionRequest | CompletionRequest, token_text,
                  timer: _Timer, state: Any, reply: Reply = plain_reply) -> AsyncIterator[str]:
    """SSE chunks of one streamed response; closing it aborts what still runs. Its usage goes
    to ``state.usage`` for the access log. An echoed prompt (with its logprobs, and vLLM's
    ``prompt_logprobs``) is each of its choices' first chunk. A chat answer that may hold tool
    calls is sent whole when it ends: its content, then ``delta.tool_calls``, in one chunk."""
    tools = reply is not plain_reply
    hold = max((len(s) for s in params.stop), default=1) - 1
    choices = [[ChoiceStream(hold) for _ in range(params.n)] for _ in prompts]
    finals: list[RequestOutput | None] = [None] * len(prompts)
    pending: list[tuple[int, RequestOutput]] = [first]
    echo = getattr(req, "echo", False)
    prompt_logprobs = getattr(req, "prompt_logprobs", None) is not None
    offsets = [0] * len(prompts)  # where each prompt's generated text starts in its choices' text
    try:
        while pending or None in finals:
            index, out = pending.pop() if pending else await anext(outputs)
            timer.saw(out)
            if out.finished:
                finals[index] = out
            if (echo or prompt_logprobs) and not any(s.started for s in choices[index]):
                text = echo_texts([prompts[index]], [out], token_text.decode)[0] if echo else ""
                offsets[index] = len(text)
                for n in range(params.n):
                    chunk = completion_chunk(header, index * params.n + n, text, None,
                                             echoed_logprobs(out, None, token_text, text)
                                             if echo and req.logprobs is not None else None)
                    if prompt_logprobs:
                        chunk["choices"][0]["prompt_logprobs"] = vllm_prompt_logprobs(out, token_text)
                    choices[index][n].started = True
                    yield sse(chunk)
            for c in out.outputs:
                stream = choices[index][c.index]
                if tools:
                    if c.finish_reason is not None and not stream.started:
                        stream.started = True
                        content, calls, finish = reply(c)
                        yield sse(header.body("chat.completion.chunk", [{
                            "index": c.index, "delta": chat_message(content, calls, delta=True),
                            "logprobs": None, "finish_reason": finish}]))
                    continue
                was_started = stream.started
                delta, new, send = stream.advance(c)
                if not send:
                    continue
                if header.kind == "chat":
                    lp = None if new is None else chat_logprobs(new, token_text)
                    yield sse(chat_chunk(header, c.index, delta, not was_started, c.finish_reason, lp))
                else:
                    offset = offsets[index] + len(stream.text) - len(delta)
                    lp = None if new is None else completion_logprobs(new, token_text, offset)
                    choice = index * params.n + c.index
                    yield sse(completion_chunk(header, choice, delta, c.finish_reason, lp))
        timer.done()
        state.usage = usage(finals)
        if req.include_usage:
            object_ = "chat.completion.chunk" if header.kind == "chat" else "text_completion"
            yield sse(header.body(object_, [], usage=state.usage))
    except (RequestFailed, EngineStopped) as err:
        yield sse(_api_error(err).body())
    finally:
        await outputs.aclose()
    yield sse("[DONE]")


class _EventStream(StreamingResponse):
    """Server-sent events that, however the response ends (done, client gone, shutdown), close
    their source (aborting its requests) and release the admission ticket."""

    def __init__(self, events: AsyncIterator[str], ticket: Ticket) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.ticket = ticket

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with suppress(RuntimeError):
                await self.body_iterator.aclose()
            self.ticket.release()


async def _unless_disconnected(request: Request, awaitable: Awaitable) -> Any:
    """``awaitable``'s result, or ``_ClientGone`` (the work cancelled) if the client leaves first."""
    work = asyncio.ensure_future(awaitable)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            raise _ClientGone()
        return work.result()
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            with suppress(BaseException):
                await work


async def _while_held(request: Request, ticket: Ticket, work: Awaitable, param: str) -> Any:
    """``work``'s result, awaited while the client waits. If the client leaves first, the work is
    cancelled and ``_ClientGone`` raised (a 499); if the work raises, its error is raised as the
    client sees it (``_api_error``: a ``ValueError``, such as a refused image, is a 400 naming
    ``param``). Either way ``ticket`` is released; on success the caller still holds it."""
    try:
        return await _unless_disconnected(request, work)
    except BaseException as err:
        ticket.release()
        raise _api_error(err, param) from None


def _decode(tokenizer: Any, tokens: list[int]) -> str:
    """``tokens`` as text; ``ValueError`` naming the first id outside the vocabulary."""
    vocab = len(tokenizer)
    outside = next((t for t in tokens if not 0 <= t < vocab), None)
    if outside is not None:
        raise ValueError(f"tokens holds {outside}; the vocabulary has tokens 0 to {vocab - 1}")
    return tokenizer.decode(tokens)


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _client_gone(_: Request, __: Exception) -> Response:
    """The answer to a client that left: nobody reads it; the access log records 499."""
    return Response(status_code=499)


async def _error_response(_: Request, err: Exception) -> Response:
    if isinstance(err, HTTPException):  # no such route, method not allowed
        return ApiError(err.status_code, str(err.detail)).response()
    if not isinstance(err, ApiError):  # a bug: logged whole, the client learns nothing of it
        log.error("request failed", exc_info=err)
        err = ApiError(500, "internal error (logged by the server)", type="server_error")
    return err.response()


def _api_error(err: BaseException, param: str | None = None) -> ApiError | BaseException:
    """``err`` as the client sees it; ``param`` names the field a ``ValueError`` is about."""
    if isinstance(err, ApiError):
        return err
    if isinstance(err, EngineStopped):
        return ApiError(503, str(err), type="server_error", code="shutting_down")
    if isinstance(err, RequestFailed):
        return ApiError(500, f"the request failed inside the engine: {err}", type="server_error")
    if isinstance(err, ValueError):  # a refused image, or the engine refused the prompt
        return ApiError(400, str(err), param=param)
    return err


def _admit(front: Front, n: int, settings: ServerSettings) -> Ticket:
    """Places for ``n`` sequences, or the error that says why not."""
    limit = front.admission.max_pending
    if n > limit:
        raise ApiError(400, f"this request runs {n} sequences (prompts times n); the server admits "
                            f"at most {limit} at once", param="n")
    try:
        return front.admit(n)
    except EngineOverloaded as err:
        raise ApiError(503, f"the server is at its admission limit ({err}); retry later",
                       type="server_error", code="overloaded",
                       headers={"Retry-After": str(settings.retry_after_seconds)}) from None
    except EngineStopped as err:
        raise _api_error(err) from None


def _chat_messages(messages: list, settings: ServerSettings) -> tuple[list[dict[str, Any]], list[str]]:
    """``template_messages``, refusing more images than ``--max-images-per-request`` (a 400)."""
    out, urls = template_messages(messages)
    if len(urls) > settings.max_images_per_request:
        raise ApiError(400, f"{len(urls)} images in one request; at most "
                            f"{settings.max_images_per_request}", param="messages")
    return out, urls


def _check_model(name: str | None, settings: ServerSettings) -> None:
    """A request naming another model is a 404; one that names none (``/tokenize`` may omit it)
    is for this one."""
    if name is not None and name != settings.served_model_name:
        raise ApiError(404, f"model {name!r} does not exist; this server serves "
                            f"{settings.served_model_name!r}", param="model", code="model_not_found")


async def _parse(model: type, request: Request, settings: ServerSettings) -> Any:
    """The request body read (within the size limit) and parsed on a worker thread, its model
    name and priority checked."""
    req = await asyncio.to_thread(parse, model, await _read_body(request, settings.max_body_bytes))
    _check_model(req.model, settings)
    low, high = settings.client_priority
    if not low <= req.priority <= high:
        allowed = ("0 (start the server with --allow-client-priority MIN MAX to let clients set "
                   "priorities)" if (low, high) == (0, 0) else f"{low} to {high}")
        raise ApiError(400, f"priority {req.priority} is not allowed; allowed: {allowed}",
                       param="priority")
    return req


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the body has {declared} bytes; the limit is {limit}", code="request_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"the body is over the limit of {limit} bytes", code="request_too_large")
    return bytes(body)


class _RequireKey:
    """ASGI middleware: every HTTP route but ``open_paths`` needs ``Authorization: Bearer <key>``
    (constant-time comparison). Load balancers probe ``/health`` without credentials; it
    answers a status and nothing else; the web page at ``/`` asks for the key itself."""

    def __init__(self, app, key: str, open_paths: set[str]) -> None:
        self.app = app
        self.expected = f"Bearer {key}".encode()
        self.open_paths = open_paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = ApiError(401, "a valid API key is required (Authorization: Bearer <key>)",
                                    type="authentication_error", code="invalid_api_key").response()
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _AccessLog:
    """ASGI middleware: one INFO line per HTTP request, when its response is done: method, path,
    status, prompt / cached / completion tokens where it generated, and latency."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] == "/health":
            await self.app(scope, receive, send)
            return
        start, status = time.perf_counter(), [0]

        async def sending(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            used = scope.get("state", {}).get("usage")
            tokens = ""
            if used is not None:
                cached = (used.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                tokens = (f" prompt={used['prompt_tokens']} cached={cached} "
                          f"completion={used['completion_tokens']}")
            access_log.info("%s %s %s%s %.3fs", scope["method"], scope["path"], status[0] or 499,
                            tokens, time.perf_counter() - start)
