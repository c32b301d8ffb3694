"""How to decode one request."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # most alternatives a token's logprobs can list (OpenAI's top_logprobs limit)
MAX_LOGIT_BIAS = 100.0  # the largest bias magnitude (OpenAI's limit)
MAX_PENALTY = 2.0  # the largest frequency or presence penalty magnitude (OpenAI's limit)
STRUCTURED_KINDS = ("json_schema", "json_object", "choice", "regex", "grammar")  # StructuredOutput's fields


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """What a request's output must be; exactly one field is set, or ``ValueError`` names them.

    ``json_schema``: a JSON schema (a dict or its JSON text); ``json_object``: any JSON object;
    ``choice``: one of these strings; ``regex``: a full match of this regular expression;
    ``grammar``: an EBNF grammar with a ``root`` rule (xgrammar's GBNF dialect)."""

    json_schema: dict | str | None = None
    json_object: bool = False
    choice: tuple[str, ...] | None = None
    regex: str | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            choice = tuple(self.choice)
            if not choice or not all(isinstance(c, str) and c for c in choice):
                raise ValueError(f"choice must be a non-empty list of non-empty strings, got {self.choice!r}")
            object.__setattr__(self, "choice", choice)
        if self.json_schema is not None and not isinstance(self.json_schema, (dict, str)):
            raise ValueError(f"json_schema must be a dict or a JSON string, got {type(self.json_schema).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        if not isinstance(self.json_object, bool):
            raise ValueError(f"json_object must be a bool, got {self.json_object!r}")
        given = [name for name in STRUCTURED_KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured output takes exactly one of json_schema, json_object, choice, "
                             f"regex, grammar; got {', '.join(given) or 'none'}")

    @property
    def kind(self) -> str:
        """The field that is set: one of ``STRUCTURED_KINDS``."""
        return next(name for name in STRUCTURED_KINDS if getattr(self, name) not in (None, False))

    def key(self) -> tuple:
        """What identifies the compiled grammar."""
        schema = self.json_schema
        if isinstance(schema, dict):
            schema = json.dumps(schema, sort_keys=True)
        return schema, self.json_object, self.choice, self.regex, self.grammar


@dataclass(slots=True)
class SamplingParams:
    """Decoding settings, validated on construction (``ValueError`` naming the field).

    ``temperature=0`` is greedy (the default, as in transformers' ``generate``). ``top_k=0`` and
    ``top_p=1`` switch those filters off. ``n`` samples share the prompt's blocks (copy-on-write).
    ``priority``: lower values are served first and preempted last (as in vLLM).
    ``seed`` makes sampling reproducible whatever else is in the batch.
    ``logprobs``: None, or return each generated token's log-probability with that many of the
    most likely alternatives (0 to ``MAX_LOGPROBS``); such a request decodes without speculation.
    ``prompt_logprobs``: None, or return each prompt token's log-probability under the model (the
    first token's is None) with that many alternatives, computed in the prompt's prefill (such a
    request reads nothing from the prefix cache). ``max_tokens=0`` computes the prompt only.
    ``structured``: a ``StructuredOutput`` the output must match (``mmkv.structured``).
    ``logit_bias``: token id -> a value in [-100, 100] added
    to that token's logit before any sampling filter (and before the structured output's mask).
    ``presence_penalty`` and ``frequency_penalty`` (in [-2, 2], OpenAI's) over the output so far,
    ``repetition_penalty`` (> 0, transformers' rule) over the prompt and the output, and
    ``min_tokens`` (no stop token, nor stop string, ends the output before that many tokens) adjust
    the logits before the bias (``mmkv.penalties``). ``min_p`` in [0, 1): after temperature, top-k and top-p, drop the
    tokens less likely than ``min_p`` times the most likely one.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    priority: int = 0
    logprobs: int | None = None
    structured: StructuredOutput | None = None
    logit_bias: dict[int, float] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    min_p: float = 0.0
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop, self.stop_token_ids = list(self.stop), list(self.stop_token_ids)
        _check_int("max_tokens", self.max_tokens, low=0)
        _check_int("top_k", self.top_k, low=0)
        _check_int("n", self.n, low=1)
        _check_int("priority", self.priority)
        if self.seed is not None:
            _check_int("seed", self.seed, low=0)
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids entries", t, low=0)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, low=0)
                if value > MAX_LOGPROBS:
                    raise ValueError(f"{name} must be <= {MAX_LOGPROBS}, got {value}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError(f"structured must be a StructuredOutput, got {type(self.structured).__name__}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}")
            for token, bias in self.logit_bias.items():
                _check_int("logit_bias token ids", token, low=0)
                if not _is_number(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                    raise ValueError(f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, "
                                     f"{MAX_LOGIT_BIAS:g}], got {bias!r} for token {token}")
            self.logit_bias = dict(self.logit_bias) or None
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        if self.max_tokens == 0 and self.n != 1:
            raise ValueError(f"max_tokens=0 (the prompt only) takes n=1, got n={self.n}")
        _check_int("min_tokens", self.min_tokens, low=0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if not _is_number(self.min_p) or not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p!r}")

    @property
    def penalised(self) -> bool:
        """Whether a penalty or ``min_tokens`` adjusts the logits (``mmkv.penalties``)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.min_tokens)

    @property
    def constrained(self) -> bool:
        """Whether the logits are changed before sampling (a structured output, a logit bias, a
        penalty or ``min_tokens``)."""
        return self.structured is not None or self.logit_bias is not None or self.penalised

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_int(name: str, value: object, low: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
