"""The contract of one forward pass, shared by attention backends, models and the runner.

A pass runs every scheduled token of every sequence as one packed row. The runner builds a
``StepContext`` for it (the paged metadata, each layer's KV pages, the attention backend, image
inputs); models hand it down to every layer; each attention layer calls its backend with it.

This module is the bottom of that stack: it imports none of the backends, models or runner, so
they can all import it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:  # data only: the paged format's records
    from mmkv.attention.metadata import CrossBatch, PagedBatch


class AttentionBackend(ABC):
    """Attention over the paged KV cache: per layer one tensor in FlashInfer's NHD layout,
    ``[num_blocks, 2, block_size, kv_heads, head_dim]``, read with the step's metadata
    (``PagedBatch``, ``CrossBatch`` from ``mmkv/attention/metadata.py``). Whatever a backend
    prepares once per step (FlashInfer's plans) it keeps in the step's ``plans``.

    Guarantees: after ``write_kv``, ``attention`` returns causal attention (within the sliding
    window, when given) of each new token over its sequence's KV; ``cross_attention`` returns
    non-causal attention of each row over the image positions the step's ``CrossBatch`` lets it
    see, zeros for rows of sequences without images; ``write_image_kv`` stores an image's K/V. For
    the same pages, metadata and inputs every backend computes the same attention up to
    floating-point rounding; the torch backend is the reference the others are checked against."""

    name: ClassVar[str]
    # write_kv stores key row i at row write_slots[i] of the layer viewed as rows of kv_heads x
    # head_dim (PagedBatch.write_slots), value row i at write_slots[T + i], and nothing else: a
    # layer may store them there itself (the fused layers' native rotary embedding does)
    writes_slots_in_place: ClassVar[bool] = False

    @abstractmethod
    def write_kv(self, step: StepContext, layer: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor) -> None:
        """Store the step's new K/V ``[T, kv_heads, head_dim]`` (packed rows) into their pages."""

    @abstractmethod
    def attention(self, step: StepContext, query: torch.Tensor, layer: torch.Tensor, scale: float,
                  sliding_window: int | None) -> torch.Tensor:
        """Output ``[T, q_heads, head_dim]`` for the packed queries ``[T, q_heads, head_dim]``."""

    @abstractmethod
    def cross_attention(self, step: StepContext, query: torch.Tensor, layer: torch.Tensor,
                        scale: float) -> torch.Tensor:
        """Output ``[T, q_heads, head_dim]`` of the packed queries over their images' pages."""

    @abstractmethod
    def write_image_kv(self, layer: torch.Tensor, pages: list[int], start: int, key: torch.Tensor,
                       value: torch.Tensor) -> None:
        """Store K/V ``[n, kv_heads, head_dim]`` of an image's positions ``start .. start + n - 1``
        into its pages (position ``p`` in page ``pages[p // block_size]``)."""


@dataclass(slots=True)
class StepContext:
    """What one forward pass needs besides token ids (passed down to every layer)."""

    batch: PagedBatch
    kv_layers: list[torch.Tensor]  # per model layer: its storage slot
    backend: AttentionBackend
    image_rows: torch.Tensor | None = None  # packed rows whose embedding comes from an image
    image_embeds: torch.Tensor | None = None
    cross: CrossBatch | None = None
    plans: dict = field(default_factory=dict)  # the backend's work prepared once for this step
    rope_positions: torch.Tensor | None = None  # long [3, T]: M-RoPE (T, H, W) positions
    check_bounds: bool = False  # native kernels check every page id and slot first (debug engines)

    def next_position(self, batch: PagedBatch) -> StepContext:
        """The context of the pass that computes each sequence's next (generated) position:
        ``batch`` is that pass's metadata; M-RoPE positions advance by one on every axis."""
        rope = self.rope_positions
        return StepContext(batch, self.kv_layers, self.backend,
                           rope_positions=None if rope is None else rope + 1,
                           check_bounds=self.check_bounds)

    def with_layers(self, kv_layers: list[torch.Tensor]) -> StepContext:
        """The same batch over other KV pages (a draft model's store of the same blocks), text
        only."""
        return StepContext(self.batch, kv_layers, self.backend, check_bounds=self.check_bounds)
