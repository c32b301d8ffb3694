"""OpenAI request bodies as the server accepts them, and OpenAI's error body.

Unknown fields are ignored (clients send many), except the sampling fields vLLM or llama-server
define that mmkv does not honour (``UNHONOURED``): a value of one that would change the output is
refused with a 400 naming the field, as are tools, suffix and a ``best_of`` other than ``n``.
Nothing that changes sampling is silently ignored. Honoured beyond OpenAI's fields: ``top_k``,
``min_p``, ``min_tokens``, ``repetition_penalty`` (and llama-server's ``repeat_penalty`` over the
whole context, ``repeat_last_n: -1``), ``ignore_eos``, ``stop_token_ids``, ``priority``,
``cache_salt``, vLLM's ``structured_outputs`` (choice, regex, json, grammar) and ``guided_*``, and
on completions ``echo`` (with the prompt tokens' logprobs first when ``logprobs`` is asked for,
``max_tokens: 0`` allowed) and vLLM's ``prompt_logprobs``.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from mmkv import SamplingParams
from mmkv.sampling_params import StructuredOutput
from mmkv.server.responses import Reply, tool_reply

MAX_N = 16  # samples per prompt
MAX_PROMPTS = 64  # prompts in one completions request
MAX_STOP = 16


class ApiError(Exception):
    """An error as a client sees it: an HTTP status and OpenAI's error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ImageURL(_Model):
    url: str
    detail: str | None = None


class TextPart(_Model):
    type: Literal["text"]
    text: str


class ImagePart(_Model):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class FunctionCall(_Model):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class AssistantToolCall(_Model):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[AssistantToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result's call


class FunctionDefinition(_Model):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class Tool(_Model):
    type: Literal["function"]
    function: FunctionDefinition


class ChosenFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: ChosenFunction


class StreamOptions(_Model):
    include_usage: bool = False


# sampling fields of vLLM and llama-server that mmkv does not honour -> the values that change nothing
UNHONOURED: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (False,), "length_penalty": (1, 1.0), "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,),
    "truncate_prompt_tokens": (None,), "allowed_token_ids": (None, []), "bad_words": (None, []),
    "logits_processors": (None, []), "return_tokens_as_token_ids": (False,),
    "typical_p": (1, 1.0), "tfs_z": (1, 1.0), "penalize_nl": (False,),
    "dry_multiplier": (0, 0.0), "xtc_probability": (0, 0.0), "mirostat": (0,), "top_n_sigma": (-1, -1.0),
    "dynatemp_range": (0, 0.0), "n_probs": (0,), "min_keep": (0,), "samplers": (None,),
    "grammar": (None, ""), "json_schema": (None, {}),
}


class _Sampling(_Model):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="allow")  # unknown fields are kept to be checked, then ignored

    model: str
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    seed: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)  # vLLM's
    repeat_penalty: float | None = Field(None, gt=0)  # llama-server's, over its last repeat_last_n tokens
    repeat_last_n: int | None = None  # -1: the whole context (llama-server's default: 64)
    min_p: float = Field(0.0, ge=0, lt=1)
    min_tokens: int = Field(0, ge=0)
    logit_bias: dict[str, float] | None = None
    top_k: int = Field(0, ge=-1)  # -1 or 0: off
    ignore_eos: bool = False
    stop_token_ids: list[StrictInt] = Field(default_factory=list)
    priority: int = 0
    cache_salt: str | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's spelling: choice, regex, json, grammar
    guided_choice: list[str] | None = None  # vLLM's older spelling
    guided_regex: str | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_grammar: str | None = None

    def check_supported(self) -> None:
        for name, value in (self.model_extra or {}).items():
            if name in UNHONOURED and not any(value == v and type(value) is type(v) for v in UNHONOURED[name]):
                allowed = " or ".join(json.dumps(v) for v in UNHONOURED[name])
                raise ApiError(400, f"{name} is not supported; allowed: {allowed}", param=name)
        if self.repeat_penalty not in (None, 1) and self.repeat_last_n != -1:
            raise ApiError(400, "repeat_penalty is applied over the whole context only: send repeat_last_n: -1 "
                                "(or vLLM's repetition_penalty)", param="repeat_penalty")
        if None not in (self.repeat_penalty, self.repetition_penalty) and self.repeat_penalty != self.repetition_penalty:
            raise ApiError(400, "repeat_penalty and repetition_penalty differ; send one", param="repeat_penalty")
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > MAX_STOP:
            raise ApiError(400, f"stop has {len(stops)} entries; at most {MAX_STOP}", param="stop")

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        structured, bias = self.structured(), self.token_bias()
        try:
            return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                                  top_k=max(self.top_k, 0), seed=self.seed, stop=self.stop or [],
                                  stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                                  n=self.n, priority=self.priority, logprobs=logprobs,
                                  structured=structured, logit_bias=bias,
                                  presence_penalty=self.presence_penalty or 0.0,
                                  frequency_penalty=self.frequency_penalty or 0.0,
                                  repetition_penalty=self.repetition_penalty or self.repeat_penalty or 1.0,
                                  min_p=self.min_p, min_tokens=self.min_tokens,
                                  prompt_logprobs=prompt_logprobs)
        except ValueError as err:
            raise ApiError(400, str(err), param=str(err).split(" ")[0]) from None

    def token_bias(self) -> dict[int, float] | None:
        """``logit_bias`` with its keys (token ids as strings, as OpenAI sends them) as integers."""
        if not self.logit_bias:
            return None
        try:
            return {int(token): bias for token, bias in self.logit_bias.items()}
        except ValueError:
            bad = next(t for t in self.logit_bias if not t.strip().lstrip("-").isdigit())
            raise ApiError(400, f"logit_bias keys must be token ids, got {bad!r}", param="logit_bias") from None

    def structured(self) -> StructuredOutput | None:
        """The structured output asked for by ``response_format`` (OpenAI), ``structured_outputs``
        or a ``guided_*`` field (vLLM); at most one of them; ``ApiError`` 400 naming a bad one."""
        asked: dict[str, dict[str, Any]] = {}
        rf = self.response_format
        if rf is not None and rf.get("type") != "text":
            kind = rf.get("type")
            if kind == "json_object":
                asked["response_format"] = {"json_object": True}
            elif kind == "json_schema":
                spec = rf.get("json_schema")
                if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                    raise ApiError(400, "response_format json_schema needs json_schema.schema, a JSON "
                                        "schema object", param="response_format")
                asked["response_format"] = {"json_schema": spec["schema"]}
            else:
                raise ApiError(400, f"response_format type must be text, json_object or json_schema, "
                                    f"got {kind!r}", param="response_format")
        if self.structured_outputs:
            names = {"choice": "choice", "regex": "regex", "json": "json_schema", "grammar": "grammar",
                     "json_object": "json_object"}
            unknown = sorted(set(self.structured_outputs) - set(names))
            if unknown:
                raise ApiError(400, f"structured_outputs takes {', '.join(names)}; got {unknown[0]!r}",
                               param="structured_outputs")
            asked["structured_outputs"] = {names[k]: v for k, v in self.structured_outputs.items()}
        for name, field in (("guided_choice", "choice"), ("guided_regex", "regex"),
                            ("guided_json", "json_schema"), ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                asked[name] = {field: getattr(self, name)}
        if len(asked) > 1:
            raise ApiError(400, f"ask for one structured output, got {', '.join(asked)}", param=next(iter(asked)))
        if not asked:
            return None
        [(param, spec)] = asked.items()
        try:
            return StructuredOutput(**spec)
        except (ValueError, TypeError) as err:
            raise ApiError(400, f"{param}: {err}", param=param) from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ApiError(400, "tool_choice needs tools", param="tool_choice")
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise ApiError(400, "tools name a function twice", param="tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ApiError(400, f"tool_choice names {self.tool_choice.function.name!r}, which is not among "
                                f"the tools ({', '.join(names)})", param="tool_choice")

    @property
    def tool_mode(self) -> str:
        """``none`` (no tools, or ``tool_choice: none``: the answer is text), ``auto`` (the model's
        answer is parsed for calls), ``required`` (one call or more, forced) or ``named`` (a call
        of the named function, forced)."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return "required" if self.tool_choice == "required" else "auto"

    def reply(self, parser: str | None) -> Reply:
        """How each sample becomes a message (``responses.tool_reply``); ``parser``: the tool-call
        format of the model (None: none known, which ``auto`` cannot do without)."""
        if self.tool_mode == "auto" and parser is None:
            raise ApiError(400, "tools with tool_choice auto need a tool-call parser, and this model's chat "
                                "template has no format mmkv knows; start mmkv serve with --tool-call-parser",
                           param="tools")
        return tool_reply(self.tool_mode, parser,
                          self.tool_choice.function.name if self.tool_mode == "named" else None)

    def tool_definitions(self) -> list[dict[str, Any]] | None:
        """The tools as chat templates take them (OpenAI's shape)."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def structured(self) -> StructuredOutput | None:
        """A forced call (``tool_choice`` ``required`` or a named function) is structured output:
        the named function's arguments under its ``parameters`` schema, or a list of calls
        (``{"name", "arguments"}``; one when ``parallel_tool_calls`` is false). It cannot be asked
        for together with another structured output."""
        asked = super().structured()
        if self.tool_mode not in ("required", "named"):
            return asked
        if asked is not None:
            raise ApiError(400, "a forced tool call (tool_choice) is structured output already; drop "
                                "response_format or the structured output field", param="tool_choice")
        functions = {t.function.name: t.function.parameters for t in self.tools}
        if self.tool_mode == "named":
            schema = functions[self.tool_choice.function.name]
        else:
            calls = [{"type": "object", "properties": {"name": {"enum": [name]}, "arguments": parameters},
                      "required": ["name", "arguments"], "additionalProperties": False}
                     for name, parameters in functions.items()]
            schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls},
                      **({} if self.parallel_tool_calls else {"maxItems": 1})}
        try:
            return StructuredOutput(json_schema=schema)
        except ValueError as err:
            raise ApiError(400, f"tools: {err}", param="tools") from None

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def explicit_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def params(self, max_model_len: int) -> SamplingParams:
        """Its sampling parameters; without an explicit limit an answer may run to the end of the
        context."""
        return self.sampling_params(self.explicit_max_tokens or max_model_len, self.requested_logprobs())


class CompletionRequest(_Sampling):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    max_tokens: int = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=20)  # vLLM's
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.max_tokens == 0 and not (self.echo or self.prompt_logprobs is not None):
            raise ApiError(400, "max_tokens: 0 needs echo: true or prompt_logprobs", param="max_tokens")
        if self.suffix:
            raise ApiError(400, "suffix is not supported", param="suffix")
        if self.best_of not in (None, self.n):
            raise ApiError(400, f"best_of must equal n ({self.n}) when given", param="best_of")

    def params(self) -> SamplingParams:
        return self.sampling_params(self.max_tokens, self.logprobs, self.requested_prompt_logprobs())

    def requested_prompt_logprobs(self) -> int | None:
        """How many alternatives each prompt token's logprob lists: ``prompt_logprobs``, or the
        ``logprobs`` of an echoed prompt (the larger when both are given)."""
        asked = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(asked) if asked else None

    def prompts(self) -> list[str | list[int]]:
        """The prompts this request holds (a string, strings, token ids, lists of token ids)."""
        p = self.prompt
        prompts = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        if not prompts:
            raise ApiError(400, "prompt is empty", param="prompt")
        if len(prompts) > MAX_PROMPTS:
            raise ApiError(400, f"prompt holds {len(prompts)} prompts; at most {MAX_PROMPTS}",
                           param="prompt")
        return prompts


class TokenizeRequest(_Model):
    """``POST /tokenize``: a completion's ``prompt`` (text or token ids) or chat ``messages``."""

    model: str | None = None
    prompt: str | list[StrictInt] | None = None
    messages: list[ChatMessage] | None = None
    cache_salt: str | None = None
    priority: int = 0

    def check_supported(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ApiError(400, "give exactly one of prompt and messages", param="prompt")


class DetokenizeRequest(_Model):
    """``POST /detokenize``: token ids back to text."""

    model: str | None = None
    tokens: list[StrictInt]
    priority: int = 0

    def check_supported(self) -> None:
        """Nothing to refuse beyond the fields' types."""


def template_messages(messages: list[ChatMessage]) -> tuple[list[dict[str, Any]], list[str]]:
    """Messages as chat templates take them (image parts as ``{"type": "image"}``) and the image
    URLs in the order their parts appear."""
    out, urls = [], []
    for i, m in enumerate(messages):
        extra: dict[str, Any] = {}
        if m.tool_calls:
            extra["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments, i)}} for c in m.tool_calls]
        if m.tool_call_id is not None:
            extra["tool_call_id"] = m.tool_call_id
        if m.content is None or isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content or "", **extra})
            continue
        parts = []
        for part in m.content:
            if part.type == "text":
                parts.append({"type": "text", "text": part.text})
            else:
                parts.append({"type": "image"})
                urls.append(part.image_url.url)
        out.append({"role": m.role, "content": parts, **extra})
    return out, urls


def _arguments(text: str, index: int) -> dict[str, Any]:
    """An earlier call's arguments (JSON text) as the object templates render."""
    try:
        arguments = json.loads(text)
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        raise ApiError(400, f"messages.{index}.tool_calls: arguments must be a JSON object as text",
                       param="messages")
    return arguments


def parse(model: type[_Model], body: bytes) -> Any:
    """The request body as ``model``, or an ``ApiError`` 400 naming the bad field."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # the decoder's message may quote the body: none of it
        raise ApiError(400, "the body is not valid JSON (or nests too deeply)") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object")
    try:
        request = model.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ApiError(400, f"{where}: {first['msg']}", param=where or None) from None
    request.check_supported()
    return request
