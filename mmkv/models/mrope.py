"""Multimodal rotary positions (M-RoPE, the Qwen-VL families): three position axes per token.

A text token advances all three axes (T, H, W) by one. An image whose first token would sit at
position ``s`` takes T = s, H = s + row, W = s + col over its merged patch grid, and the text after
it resumes at ``s + max(rows, cols)``, so a sequence's positions fall behind its indices by a fixed
``delta`` (≤ 0) after its last image.

Invariant: a sequence's positions are computed once, from its whole prompt, when it is submitted,
and never change; every step (a prefill chunk after a prefix hit, a recomputation after
preemption, a decode step, a speculative draft or verification pass) reads the slice of the
positions it computes, so the same token always gets the same position.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True, frozen=True)
class MRopePositions:
    """The (T, H, W) positions of one sequence. ``head`` holds them explicitly up to the end of its
    last image (empty for text only); from there on, token ``i`` is at ``i + delta`` on every axis,
    generated tokens included (they are text, whatever their id)."""

    head: np.ndarray  # int64 [3, end of the last image]
    delta: int

    @classmethod
    def text(cls) -> "MRopePositions":
        return cls(np.zeros((3, 0), dtype=np.int64), 0)

    def between(self, lo: int, hi: int) -> np.ndarray:
        """Positions ``[3, hi - lo]`` of tokens ``lo .. hi - 1``."""
        k = self.head.shape[1]
        if lo >= k:
            return np.broadcast_to(np.arange(lo + self.delta, hi + self.delta), (3, hi - lo))
        if hi <= k:
            return self.head[:, lo:hi]
        tail = np.broadcast_to(np.arange(k + self.delta, hi + self.delta), (3, hi - k))
        return np.concatenate([self.head[:, lo:], tail], axis=1)


def step_positions(ropes: list[MRopePositions], q_lens: list[int], kv_lens: list[int]) -> np.ndarray:
    """Positions ``[3, sum(q_lens)]`` of a step that computes the last ``q_lens[i]`` of the first
    ``kv_lens[i]`` tokens of each sequence, packed in order."""
    return np.concatenate([r.between(n - q, n) for r, q, n in zip(ropes, q_lens, kv_lens)], axis=1)
