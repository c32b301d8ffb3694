"""Exact verification of drafted tokens.

Greedy: accept drafted tokens while each equals the target's argmax; the first disagreement is
replaced by the target's token, and when every draft is accepted the target's next token comes as a
bonus. The output is token for token the target's greedy output.

Sampling (Leviathan et al. 2023; Chen et al. 2023): accept draft ``x`` drawn from ``q`` with
probability ``min(1, p(x) / q(x))``; on rejection draw from ``norm(max(0, p - q))``; when all are
accepted draw a bonus token from the target's next distribution. The tokens are then distributed
exactly as if sampled from the target alone.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mmkv.sampler import draw


class Verdict(NamedTuple):
    """``tokens`` are the new tokens (accepted drafts, then one from the target); ``accepted``
    counts the accepted drafts."""

    tokens: list[int]
    accepted: int


def verify_greedy(drafts: list[int], target_logits: torch.Tensor) -> Verdict:
    """``target_logits`` ``[len(drafts) + 1, vocab]``: row ``i`` predicts the token after the
    ``i``-th input (the last accepted token, then each draft)."""
    return greedy_verdict(drafts, target_logits.argmax(dim=-1).tolist())


def greedy_verdict(drafts: list[int], best: list[int]) -> Verdict:
    """``verify_greedy`` given the target's argmax at each row (one ``argmax`` can serve a whole
    batch's rows)."""
    n = 0
    while n < len(drafts) and drafts[n] == best[n]:
        n += 1
    return Verdict(drafts[:n] + [best[n]], n)


def verify_sampling(drafts: list[int], draft_probs: torch.Tensor, target_probs: torch.Tensor,
                    generator: torch.Generator | None) -> Verdict:
    """``draft_probs`` ``[k, vocab]`` the distributions the drafts were drawn from;
    ``target_probs`` ``[k + 1, vocab]`` the target's. All on the CPU, float32. The ``k`` uniforms
    of the acceptance tests are drawn at once (those after a rejection go unused: independent
    draws, so the verdict's distribution is the same)."""
    k = len(drafts)
    if k:
        rows, tokens = torch.arange(k), torch.tensor(drafts)
        uniforms = torch.rand(k, generator=generator)
        rejected = (uniforms * draft_probs[rows, tokens] > target_probs[rows, tokens]).tolist()
        if True in rejected:  # rejected with probability 1 - min(1, p/q): draw from max(0, p - q)
            i = rejected.index(True)
            residual = (target_probs[i] - draft_probs[i]).clamp_min(0)
            weights = residual if residual.sum() > 0 else target_probs[i]
            return Verdict(drafts[:i] + draw(weights[None], [generator]), i)
    return Verdict(list(drafts) + draw(target_probs[k:k + 1], [generator]), k)
