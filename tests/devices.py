"""Where the engine tests that support it run: ``MMKV_TEST_DEVICE`` (``cpu``, the default, or
``cuda``).

On the CPU engines run in float32 and greedy output must equal transformers' ``generate`` token
for token. On CUDA they run in bfloat16, whose rounding can flip a near-tie, so greedy output is
checked against transformers' float32 logits on the same tokens (teacher-forced): every generated
token must be the argmax up to ``NEAR_TIE`` of that position's logit spread.
"""

from __future__ import annotations

import os

import torch

DEVICE = os.environ.get("MMKV_TEST_DEVICE", "cpu")
if DEVICE not in ("cpu", "cuda"):
    raise ValueError(f"MMKV_TEST_DEVICE must be 'cpu' or 'cuda', got {DEVICE!r}")
DTYPE = "float32" if DEVICE == "cpu" else "bfloat16"
ELEMENT_BYTES = 4 if DEVICE == "cpu" else 2
# Measured on a CPU in bfloat16 (greedy, 24 tokens after 200-token prompts): correct engines
# picked tokens at most 0.27 standard deviations of the row's logits below the float32 argmax on
# 2- and 8-layer Llamas of hidden 256 (0.40 once on other prompts); attention with its scale off
# by 30 %, or missing the three oldest keys, 0.77 to 1.46.
NEAR_TIE = 0.5


def deficits(logits: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """For each token (``logits[i]`` are float32 logits of the position that chose ``tokens[i]``):
    how far below the row's argmax it lies, in standard deviations of the row (0: the argmax)."""
    logits = logits.float()
    chosen = logits[torch.arange(len(tokens)), torch.tensor(tokens, device=logits.device)]
    return ((logits.max(-1).values - chosen) / logits.std(-1)).cpu()


def assert_within_near_ties(logits: torch.Tensor, tokens: list[int]) -> None:
    d = deficits(logits, tokens)
    worst = int(d.argmax())
    assert d[worst] <= NEAR_TIE, (
        f"token {worst} of {len(tokens)} ({tokens[worst]}) lies {float(d[worst]):.2f} logit "
        f"standard deviations below the float32 argmax (allowed: {NEAR_TIE})")


@torch.inference_mode()
def assert_near_greedy(model, prompt: list[int], tokens: list[int]) -> None:
    """``tokens`` continue ``prompt`` greedily up to near-ties, by the causal LM ``model``'s
    float32 logits on the whole sequence."""
    ids = torch.tensor([prompt + tokens], device=next(model.parameters()).device)
    assert_within_near_ties(model(ids).logits[0, len(prompt) - 1:-1], tokens)
