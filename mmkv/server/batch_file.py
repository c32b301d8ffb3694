"""``mmkv run-batch``: an OpenAI batch file through one engine.

Each input line is a request in OpenAI's batch format: ``{"custom_id", "method": "POST", "url":
"/v1/chat/completions" | "/v1/completions", "body"}``, the body what ``mmkv serve`` takes at that
URL (images as ``data:`` URLs). Every line is checked first; then all of them are submitted to one
engine together, so images and prefixes that lines share are computed once, and the engine runs
them to the end behind a progress bar.

Guarantees: one result line per input line, in input order, each with the line's ``custom_id``:
``{"id", "custom_id", "response": {"status_code": 200, "request_id", "body"}, "error": null}``,
the body what the server would have answered; a line that cannot run gets ``status_code`` 400 and
the server's error body naming what was wrong (or, when it is not even a JSON object with a
``custom_id``, ``response`` null and ``error`` set), and the others go on. No line is lost or
answered twice.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass
from typing import Any, Iterable

from tqdm import tqdm

from mmkv.engine import Engine
from mmkv.outputs import RequestOutput
from mmkv.server.async_engine import AsyncEngine, ChatPrompt, RequestFailed
from mmkv.server.media import MediaLoader, MediaPolicy
from mmkv.server.protocol import (ApiError, ChatCompletionRequest, CompletionRequest, parse,
                                  template_messages)
from mmkv.server.responses import Header, chat_completion, completion, echo_texts
from mmkv.server.tool_calls import parser_for

UNBOUNDED = 1 << 30  # a batch job queues all it is given: admission never refuses
CHAT = "/v1/chat/completions"
URLS = {CHAT: ChatCompletionRequest, "/v1/completions": CompletionRequest}


@dataclass(slots=True)
class _Line:
    """One input line on its way: its custom_id, what it asks, its result."""

    custom_id: str | None
    url: str = ""
    request: Any = None
    result: dict[str, Any] | None = None


def run_batch(engine: Engine, lines: Iterable[str], progress: bool = True) -> list[dict[str, Any]]:
    """The result lines of ``lines`` (OpenAI batch requests), in order, on ``engine``."""
    front = AsyncEngine(engine, max_pending=UNBOUNDED)
    front.start()
    try:
        return asyncio.run(answer_lines(front, list(lines), progress))
    finally:
        front.stop()
        front.join()


async def answer_lines(front: AsyncEngine, lines: list[str], progress: bool = False) -> list[dict[str, Any]]:
    """``run_batch`` on a running front: every line checked, then all of them in flight at once
    (one continuous batch), each result where its line was."""
    seen: set[str] = set()
    todo = [check_line(text, seen) for text in lines if text.strip()]
    media = MediaLoader(MediaPolicy())
    with tqdm(total=len(todo), desc="requests", unit="req", disable=not progress) as bar:
        async def one(line: _Line) -> None:
            if line.result is None:
                line.result = await _run(front, line, media)
            bar.update(1)

        await asyncio.gather(*(one(line) for line in todo))
    return [line.result for line in todo]


def check_line(text: str, seen: set[str]) -> _Line:
    """A line parsed and checked, or with its error result already set."""
    try:
        data = json.loads(text)
    except ValueError:
        return _Line(None, result=_unusable(None, "the line is not valid JSON"))
    custom_id = data.get("custom_id") if isinstance(data, dict) else None
    if not isinstance(custom_id, str) or not custom_id:
        return _Line(None, result=_unusable(None, "the line needs a custom_id string"))
    line = _Line(custom_id)
    if custom_id in seen:
        line.result = _refused(line, ApiError(400, f"custom_id {custom_id!r} is used by an earlier line",
                                              param="custom_id"))
        return line
    seen.add(custom_id)
    if data.get("method", "POST") != "POST" or data.get("url") not in URLS:
        line.result = _refused(line, ApiError(400, f"method must be POST and url one of {', '.join(URLS)}; got "
                                                   f"{data.get('method')!r} {data.get('url')!r}", param="url"))
        return line
    line.url = data["url"]
    try:
        line.request = parse(URLS[line.url], json.dumps(data.get("body")).encode())
        if line.request.stream:
            raise ApiError(400, "stream is not supported in a batch", param="stream")
    except ApiError as err:
        line.result = _refused(line, err)
    return line


async def _run(front: AsyncEngine, line: _Line, media: MediaLoader) -> dict[str, Any]:
    """One line's requests through the front: its result body, or its refusal."""
    req = line.request
    try:
        if isinstance(req, ChatCompletionRequest):
            params = req.params(front.max_model_len)
            reply = req.reply(parser_for(front.tokenizer))
            messages, urls = template_messages(req.messages)
            prompts: list[Any] = [ChatPrompt(messages, await media.load_all(urls), req.tool_definitions())]
        else:
            params = req.params()
            prompts = req.prompts()
        outs: list[RequestOutput | None] = [None] * len(prompts)
        async for index, out in front.generate(prompts, params, req.cache_salt, stream=False):
            if out.finished:
                outs[index] = out
    except ApiError as err:
        return _refused(line, err)
    except ValueError as err:
        return _refused(line, ApiError(400, str(err)))
    except RequestFailed as err:
        return _refused(line, ApiError(500, str(err), type="server_error"))
    decode = front.tokenizer.decode
    text = lambda token: decode([token])  # noqa: E731
    if line.url == CHAT:
        body = chat_completion(Header("chat", req.model), outs[0], text, reply)
    else:
        body = completion(Header("completion", req.model), outs, text,
                          echo_texts(prompts, outs, decode) if req.echo else None,
                          req.logprobs is not None, req.prompt_logprobs is not None)
    return _result(line.custom_id, {"status_code": 200, "request_id": body["id"], "body": body})


def _refused(line: _Line, err: ApiError) -> dict[str, Any]:
    return _result(line.custom_id, {"status_code": err.status, "request_id": None, "body": err.body()})


def _unusable(custom_id: str | None, message: str) -> dict[str, Any]:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
            "error": {"code": "invalid_request", "message": message}}


def _result(custom_id: str | None, response: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response, "error": None}
