"""OpenAI response bodies and stream chunks built from engine outputs.

Streaming keeps one rule: the concatenated deltas of a choice equal the text of its finished
output. While a choice runs, text that a stop string could still cut (its last ``longest stop - 1``
characters), that ends inside a multi-byte character, or trailing spaces (a tokenizer's clean-up
takes a space back when "," or "." follows) are held back until the next chunk.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Callable

from mmkv import CompletionOutput, RequestOutput
from mmkv.detokenizer import UNSETTLED
from mmkv.outputs import Reuse, TokenLogprob
from mmkv.server.tool_calls import PARSERS, ToolCall, new_call

TokenText = Callable[[int], str]  # a token id's text


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(outputs: list[RequestOutput]) -> dict[str, Any]:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.cached_tokens for o in outputs)},
            "mmkv": {name: sum(getattr(o.reuse, name) for o in outputs if o.reuse is not None)
                     for name in Reuse.__slots__}}


def chat_logprobs(logprobs: list[TokenLogprob], text: TokenText) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        t = text(token_id)
        return {"token": t, "logprob": logprob, "bytes": list(t.encode())}

    return {"content": [{**entry(lp.token_id, lp.logprob),
                         "top_logprobs": [entry(i, v) for i, v in lp.top]} for lp in logprobs]}


def completion_logprobs(logprobs: list[TokenLogprob | None], text: TokenText, offset: int,
                        token_ids: list[int] | None = None) -> dict[str, Any]:
    """OpenAI's completion logprobs of ``logprobs`` whose text starts at ``offset``; an entry may
    be None (a prompt's first token, which nothing predicts: ``token_ids`` name the tokens)."""
    ids = token_ids if token_ids is not None else [lp.token_id for lp in logprobs]
    tokens = [text(i) for i in ids]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [None if lp is None else lp.logprob for lp in logprobs],
            "top_logprobs": [None if lp is None else {text(i): v for i, v in lp.top} for lp in logprobs],
            "text_offset": offsets}


def echoed_logprobs(out: RequestOutput, c: CompletionOutput | None, text: TokenText,
                    echo: str) -> dict[str, Any]:
    """The logprobs of an echoed prompt (the text ``echo``), then of the sample ``c`` so far."""
    prompt = completion_logprobs(out.prompt_logprobs, text, 0, out.prompt_token_ids)
    if c is None or c.logprobs is None or not c.logprobs:
        return prompt
    generated = completion_logprobs(c.logprobs, text, len(echo))
    return {key: prompt[key] + generated[key] for key in prompt}


def echo_texts(prompts: list, outs: list[RequestOutput], decode: Callable[[list[int]], str]) -> list[str]:
    """Each prompt's text as ``echo`` gives it back: the string it was, or its token ids decoded."""
    return [p if isinstance(p, str) else decode(o.prompt_token_ids) for p, o in zip(prompts, outs)]


def vllm_prompt_logprobs(out: RequestOutput, text: TokenText) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: for each prompt token but the first, its own logprob and rank
    and the likeliest tokens', by token id."""
    def entry(lp: TokenLogprob) -> dict[str, Any]:
        ranked = {i: {"logprob": v, "rank": r, "decoded_token": text(i)} for r, (i, v) in enumerate(lp.top, 1)}
        ranked.setdefault(lp.token_id, {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": text(lp.token_id)})
        return {str(i): v for i, v in ranked.items()}

    return [None if lp is None else entry(lp) for lp in out.prompt_logprobs]


class Header:
    """What every body and chunk of one response repeats."""

    def __init__(self, kind: str, model: str) -> None:
        self.kind, self.model = kind, model
        self.id = new_id("chatcmpl" if kind == "chat" else "cmpl")
        self.created = int(time.time())

    def body(self, object_: str, choices: list, **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": object_, "created": self.created, "model": self.model,
                "choices": choices, **extra}


Reply = Callable[[CompletionOutput], tuple[str | None, list[ToolCall], str | None]]


def plain_reply(c: CompletionOutput) -> tuple[str | None, list[ToolCall], str | None]:
    return c.text, [], c.finish_reason


def tool_reply(mode: str, parser: str | None, named: str | None = None) -> Reply:
    """A sample's content, tool calls and finish reason under ``mode`` (``ChatCompletionRequest.
    tool_mode``): ``auto`` parses the text with ``parser``; ``named`` reads it as the named
    function's arguments and ``required`` as a list of calls (both forced by a schema; a text cut
    short by ``max_tokens`` comes back as content). With calls, the finish reason is
    ``tool_calls``."""
    def reply(c: CompletionOutput) -> tuple[str | None, list[ToolCall], str | None]:
        text, calls = c.text, []
        if mode == "auto":
            content, calls = PARSERS[parser](text)
        else:
            content = text
            try:
                value = json.loads(text)
            except ValueError:
                value = None
            if mode == "named" and isinstance(value, dict):
                content, calls = None, [new_call(named, text.strip())]
            elif mode == "required" and isinstance(value, list) and value:
                content, calls = None, [new_call(v["name"], v["arguments"]) for v in value]
        return content, calls, "tool_calls" if calls else c.finish_reason

    return reply if mode != "none" else plain_reply


def chat_message(content: str | None, calls: list[ToolCall], delta: bool = False) -> dict[str, Any]:
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [call.as_openai(i if delta else None) for i, call in enumerate(calls)]
    return message


def chat_completion(header: Header, out: RequestOutput, text: TokenText,
                    reply: Reply = plain_reply) -> dict[str, Any]:
    choices = []
    for c in out.outputs:
        content, calls, finish = reply(c)
        choices.append({"index": c.index, "message": chat_message(content, calls),
                        "logprobs": None if c.logprobs is None else chat_logprobs(c.logprobs, text),
                        "finish_reason": finish})
    return header.body("chat.completion", choices, usage=usage([out]))


def completion(header: Header, outs: list[RequestOutput], text: TokenText, echo: list[str] | None = None,
               logprobs: bool = False, prompt_logprobs: bool = False) -> dict[str, Any]:
    """A completions body; ``echo``: each prompt's text (``echo_texts``), put before its samples'
    (and, with ``logprobs``, its tokens' logprobs before theirs); ``prompt_logprobs``: vLLM's
    field too."""
    n = len(outs[0].outputs)
    choices = []
    for p, o in enumerate(outs):
        for c in o.outputs:
            choice = {"index": p * n + c.index, "text": c.text, "finish_reason": c.finish_reason,
                      "logprobs": None if c.logprobs is None else completion_logprobs(c.logprobs, text, 0)}
            if echo is not None:
                choice["text"] = echo[p] + c.text
                if logprobs:
                    choice["logprobs"] = echoed_logprobs(o, c, text, echo[p])
            if prompt_logprobs:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(o, text)
            choices.append(choice)
    return header.body("text_completion", choices, usage=usage(outs))


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class ChoiceStream:
    """What of one choice has been sent: its text so far and how many tokens."""

    def __init__(self, hold: int) -> None:
        self.hold = hold  # characters a stop string could still take back
        self.text = ""
        self.tokens = 0
        self.started = False

    def advance(self, c: CompletionOutput) -> tuple[str, list[TokenLogprob] | None, bool]:
        """The new text, the new tokens' logprobs, and whether anything is worth a chunk."""
        visible = c.text
        if c.finish_reason is None:
            visible = visible[: max(len(self.text), len(visible) - self.hold)]
            while visible.endswith(UNSETTLED) and len(visible) > len(self.text):
                visible = visible[:-1]
        delta = visible[len(self.text):]
        new = None if c.logprobs is None else c.logprobs[self.tokens:]
        self.text += delta
        self.tokens = len(c.token_ids)
        send = bool(delta or new) or (not self.started and self.tokens > 0) or c.finish_reason is not None
        self.started = self.started or send
        return delta, new, send


def chat_chunk(header: Header, index: int, delta: str, first: bool, finish: str | None,
               logprobs: dict[str, Any] | None) -> dict[str, Any]:
    message = {"role": "assistant", "content": delta} if first else ({"content": delta} if delta else {})
    return header.body("chat.completion.chunk", [{"index": index, "delta": message,
                                                  "logprobs": logprobs, "finish_reason": finish}])


def completion_chunk(header: Header, index: int, delta: str, finish: str | None,
                     logprobs: dict[str, Any] | None) -> dict[str, Any]:
    return header.body("text_completion", [{"index": index, "text": delta, "logprobs": logprobs,
                                            "finish_reason": finish}])
