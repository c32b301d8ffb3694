"""Tool calls parsed out of a model's text, in the formats chat templates teach models.

- ``hermes`` (Qwen2 / Qwen2.5, Qwen2-VL / Qwen2.5-VL, Hermes): each call is
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; text outside the tags is content.
- ``llama3_json`` (Llama 3.1 / 3.2 / 3.3): the whole answer is one or more JSON objects
  ``{"name": ..., "parameters": {...}}`` (``arguments`` also read), separated by ``;`` or new
  lines, optionally after ``<|python_tag|>``.

Invariant: a parser never raises on what a model wrote. Text that is not a well-formed call (bad
JSON, no name, arguments that are not an object) comes back whole as content with no calls, as
vLLM and llama-server do, so a client sees what the model said rather than an error.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text (OpenAI's shape)."""

    name: str
    arguments: str
    id: str

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def new_call(name: str, arguments: Any) -> ToolCall:
    """A call with a fresh id; ``arguments`` a dict (dumped) or JSON text (kept)."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(name, text, f"call_{uuid.uuid4().hex[:24]}")


def _call(obj: Any, argument_keys: tuple[str, ...]) -> ToolCall | None:
    """``obj`` as a call, or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = next((obj[k] for k in argument_keys if k in obj), {})
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return new_call(obj["name"], arguments)


_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """Content (None when there is none) and the calls of a Hermes-format answer."""
    if "<tool_call>" not in text:
        return text, []
    calls = []
    for body in _HERMES.findall(text):
        try:
            call = _call(json.loads(body.strip()), ("arguments", "parameters"))
        except ValueError:
            call = None
        if call is None:
            return text, []
        calls.append(call)
    content = _HERMES.sub("", text).strip()
    return content or None, calls


def parse_llama3_json(text: str) -> tuple[str | None, list[ToolCall]]:
    """Content (None when there is none) and the calls of a Llama 3 JSON-format answer."""
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):].strip()
    if not body.startswith("{"):
        return text, []
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            obj, at = decoder.raw_decode(body, at)
        except ValueError:
            return text, []
        call = _call(obj, ("parameters", "arguments"))
        if call is None:
            return text, []
        calls.append(call)
        while at < len(body) and body[at] in " \t\r\n;":
            at += 1
    return None, calls


PARSERS: dict[str, Callable[[str], tuple[str | None, list[ToolCall]]]] = {
    "hermes": parse_hermes, "llama3_json": parse_llama3_json}


def parser_for(tokenizer: object, override: str | None = None) -> str | None:
    """``override`` (``--tool-call-parser``), else the parser the tokenizer's chat template calls for."""
    template = getattr(tokenizer, "chat_template", None)
    return override or parser_for_template(template if isinstance(template, str) else None)


def parser_for_template(template: str | None) -> str | None:
    """The parser a chat template's own format calls for (None: no known format)."""
    if not template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or '"parameters"' in template:
        return "llama3_json"
    return None
