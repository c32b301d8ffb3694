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


def completion_logprobs(logprobs: list[TokenLogprob], text: TokenText, offset: int) -> dict[str, Any]:
    tokens = [text(lp.token_id) for lp in logprobs]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{text(i): v for i, v in lp.top} for lp in logprobs],
            "text_offset": offsets}


class Header:
    """What every body and chunk of one response repeats."""

    def __init__(self, kind: str, model: str) -> None:
        self.kind, self.model = kind, model
        self.id = new_id("chatcmpl" if kind == "chat" else "cmpl")
        self.created = int(time.time())

    def body(self, object_: str, choices: list, **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": object_, "created": self.created, "model": self.model,
                "choices": choices, **extra}


def chat_completion(header: Header, out: RequestOutput, text: TokenText) -> dict[str, Any]:
    choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": None if c.logprobs is None else chat_logprobs(c.logprobs, text),
                "finish_reason": c.finish_reason} for c in out.outputs]
    return header.body("chat.completion", choices, usage=usage([out]))


def completion(header: Header, outs: list[RequestOutput], text: TokenText) -> dict[str, Any]:
    n = len(outs[0].outputs)
    choices = [{"index": p * n + c.index, "text": c.text,
                "logprobs": None if c.logprobs is None else completion_logprobs(c.logprobs, text, 0),
                "finish_reason": c.finish_reason} for p, o in enumerate(outs) for c in o.outputs]
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
