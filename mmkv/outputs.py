"""What the engine hands back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple


class TokenLogprob(NamedTuple):
    """A token's log-probability under the model (log-softmax of its logits, before temperature
    and filters) and the ``top`` most likely tokens there, most likely first; a prompt token's
    also carries its ``rank`` among every token there (1: the likeliest)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a request. ``finish_reason`` is ``"stop"``, ``"length"`` or None while running.
    ``logprobs`` (one per token, when ``SamplingParams.logprobs`` asked for them) or None.

    ``text`` is ``decoded`` when given, else ``decode(token_ids)`` on first read: every step hands
    back an output for each request it advanced, and most are never read before their request
    ends (``generate`` reads the last), and decoding each one every step would make the
    tokenizer's work grow with the square of the output length. Pickled, it carries its text, not
    the function that decodes it."""

    index: int
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None
    decode: Callable[[list[int]], str] | None = field(default=None, repr=False, compare=False)
    decoded: str | None = field(default=None, repr=False, compare=False)

    @property
    def text(self) -> str:
        if self.decoded is None:
            self.decoded = self.decode(self.token_ids) if self.decode is not None else ""
        return self.decoded

    def __reduce__(self):
        return CompletionOutput, (self.index, self.token_ids, self.finish_reason, self.logprobs,
                                  None, self.text)


@dataclass(slots=True)
class Reuse:
    """What a request's prompt took from the caches and what it computed (fixed at its first
    admission): ``images`` in it, of which the encoder ran for ``images_encoded``; image
    cross-attention K/V blocks it computed and those it took from the cache; prompt tokens whose
    K/V it computed (``prompt_tokens_computed``: the prompt less its cached prefix)."""

    images: int = 0
    images_encoded: int = 0
    xattn_blocks_computed: int = 0
    xattn_blocks_reused: int = 0
    prompt_tokens_computed: int = 0

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(slots=True)
class RequestOutput:
    """A request's prompt and its ``n`` samples; ``text``/``token_ids``/``finish_reason`` are those
    of the first sample, for the common ``n == 1`` case."""

    request_id: int
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    cached_tokens: int
    error: str | None = None  # set instead of outputs when the request was rejected
    reuse: Reuse | None = None  # what the prompt took from the caches (None: rejected)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt token (the first: None)

    @property
    def text(self) -> str:
        return self.outputs[0].text if self.outputs else ""

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids if self.outputs else []

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason if self.outputs else None
