"""Next-token choice from logits: greedy, or temperature / top-k / top-p sampling.

Each sampled sequence draws from its own ``torch.Generator``, so a seeded request gets the same
tokens whatever else shares its batch.
"""

from __future__ import annotations

import torch

from mmkv.outputs import TokenLogprob
from mmkv.sampling_params import SamplingParams


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution one sampling step draws from (float32 ``[vocab]``)."""
    logits = logits.float() / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(before >= params.top_p, 0.0)  # keep the nucleus
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum()
    return probs


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of ``logits`` ``[rows, vocab]``."""
    greedy = logits.argmax(dim=-1).tolist()
    out = []
    for row, (p, g, best) in enumerate(zip(params, generators, greedy)):
        if p.greedy:
            out.append(best)
        else:
            probs = filtered_probs(logits[row], p).cpu()
            out.append(int(torch.multinomial(probs, 1, generator=g)))
    return out


def token_logprob(logprobs: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """``token``'s entry of ``logprobs`` (a log-softmax ``[vocab]``) and the ``top`` largest."""
    values, ids = torch.topk(logprobs, top) if top else (logprobs[:0], logprobs[:0])
    return TokenLogprob(token, float(logprobs[token]), list(zip(ids.tolist(), values.tolist())))
