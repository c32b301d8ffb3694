"""What the engine hands back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class TokenLogprob(NamedTuple):
    """A generated token's log-probability under the model (log-softmax of its logits, before
    temperature and filters) and the ``top`` most likely tokens there, most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a request. ``finish_reason`` is ``"stop"``, ``"length"`` or None while running.
    ``logprobs`` (one per token, when ``SamplingParams.logprobs`` asked for them) or None."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None


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

    @property
    def text(self) -> str:
        return self.outputs[0].text if self.outputs else ""

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids if self.outputs else []

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason if self.outputs else None
