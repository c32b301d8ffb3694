"""Next-token choice from logits: greedy, or temperature / top-k / top-p / min-p sampling.

Each sampled sequence draws from its own ``torch.Generator``, so a seeded request gets the same
tokens whatever else shares its batch.
"""

from __future__ import annotations

import ctypes
import functools
import math

import torch

from mmkv import native
from mmkv.outputs import TokenLogprob
from mmkv.sampling_params import SamplingParams

_TOP_TOKENS_ARGS = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                    ctypes.c_void_p]


@functools.cache
def top_tokens_kernel() -> ctypes._CFuncPtr | None:
    """``mmkv/native/top_tokens.c``, or ``None`` (disabled, or it could not be built)."""
    return native.function("mmkv_top_tokens", _TOP_TOKENS_ARGS, None)


def top_tokens(logits: torch.Tensor, with_probs: bool = False) -> tuple[list[int], list[float] | None]:
    """Each row's most likely token (``argmax``, the first of equals) and, ``with_probs``, its
    probability (softmax's largest value) of ``logits`` ``[rows, vocab]``. Float32 rows on the CPU
    take one native call (``mmkv/native/top_tokens.c``) in place of torch's softmax, max and host
    copies; others take torch's operations."""
    kernel = top_tokens_kernel()
    if kernel is None or logits.dtype != torch.float32 or not logits.is_cpu or logits.stride(-1) != 1:
        tokens = logits.argmax(dim=-1).tolist()
        return tokens, torch.softmax(logits.float(), -1).amax(dim=-1).tolist() if with_probs else None
    rows = logits.shape[0]
    tokens = (ctypes.c_int64 * rows)()
    probs = (ctypes.c_float * rows)() if with_probs else None
    kernel(logits.data_ptr(), rows, logits.shape[1], logits.stride(0), tokens, probs)
    return list(tokens), None if probs is None else list(probs)


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution one sampling step draws from (float32 ``[..., vocab]``: each row alone)."""
    logits = logits.float() / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(before >= params.top_p, 0.0)  # keep the nucleus
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    if params.min_p:
        probs = probs.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def row_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Each row's ``filtered_probs`` by its ``params`` (float32 ``[rows, vocab]`` on the CPU), in
    one ``filtered_probs`` call per distinct filter among the rows rather than one per row."""
    groups: dict[tuple, list[int]] = {}
    for row, p in enumerate(params):
        groups.setdefault((p.temperature, p.top_k, p.top_p, p.min_p), []).append(row)
    if len(groups) == 1:
        return filtered_probs(logits, params[0]).cpu()
    probs = torch.empty(logits.shape, dtype=torch.float32)
    for rows in groups.values():
        index = torch.tensor(rows)
        probs[index] = filtered_probs(logits[index.to(logits.device)], params[rows[0]]).cpu()
    return probs


def draw(weights: torch.Tensor, generators: list[torch.Generator | None]) -> list[int]:
    """One token from each row of ``weights`` ``[rows, vocab]`` (a distribution, or weights
    proportional to one; on the CPU) by inverse transform: one float64 uniform from the row's
    generator, placed among the row's cumulative weights, so a token of weight 0 is never drawn
    (torch's ``multinomial`` draws a random number for every token of the vocabulary).
    ``ValueError`` names a row whose weights do not sum to a positive, finite number."""
    cumulative = weights.double().cumsum(-1)
    totals = cumulative[:, -1].tolist()
    for row, total in enumerate(totals):
        if not 0.0 < total < math.inf:
            raise ValueError(f"row {row} has no token of positive, finite probability to sample")
    targets = [total * float(torch.rand((), dtype=torch.float64, generator=g))
               for total, g in zip(totals, generators)]
    tokens = torch.searchsorted(cumulative, torch.tensor(targets, dtype=torch.float64)[:, None], right=True)
    return [min(token, weights.shape[-1] - 1) for token in tokens.flatten().tolist()]


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of ``logits`` ``[rows, vocab]``: the greedy rows' argmax, the sampled
    rows drawn together (``row_probs``, ``draw``), each with its own generator."""
    out = top_tokens(logits)[0]
    sampled = [row for row, p in enumerate(params) if not p.greedy]
    if sampled:
        probs = row_probs(logits if len(sampled) == len(params) else logits[sampled],
                          [params[row] for row in sampled])
        for row, token in zip(sampled, draw(probs, [generators[row] for row in sampled])):
            out[row] = token
    return out


def token_logprob(logprobs: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """``token``'s entry of ``logprobs`` (a log-softmax ``[vocab]``) and the ``top`` largest."""
    values, ids = torch.topk(logprobs, top) if top else (logprobs[:0], logprobs[:0])
    return TokenLogprob(token, float(logprobs[token]), list(zip(ids.tolist(), values.tolist())))
