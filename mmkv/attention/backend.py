"""What every attention backend does, and how an engine picks one.

A backend attends over the paged KV cache (per layer one tensor in FlashInfer's NHD layout,
``[num_blocks, 2, block_size, kv_heads, head_dim]``) with the step's metadata (``PagedBatch``,
``CrossBatch`` from ``metadata.py``). Whatever it prepares once per step (FlashInfer's plans) it
keeps in the step's ``plans``; per layer it writes the new K/V, then attends.

Invariant: for the same pages, metadata and inputs, every backend computes the same attention up
to floating-point rounding; the torch backend is the reference the others are checked against.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from mmkv.models.base import StepContext

CHOICES = ("auto", "torch", "flashinfer")
# What "auto" picks, on every device, until the FlashInfer backend has passed its GPU checks
# (tests/gpu/run_device_checks.sh) on real hardware; until then "flashinfer" is opt-in.
AUTO = "torch"


class AttentionBackend(ABC):
    """Guarantees: after ``write_kv``, ``attention`` returns causal attention (within the sliding
    window, when given) of each new token over its sequence's KV; ``cross_attention`` returns
    non-causal attention of each row over the image positions the step's ``CrossBatch`` lets it
    see, zeros for rows of sequences without images; ``write_image_kv`` stores an image's K/V."""

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


def choose_backend(choice: str | AttentionBackend, device: torch.device,
                   models: list[tuple[torch.dtype, int]]) -> AttentionBackend:
    """The backend an engine asked for with ``choice`` (an instance is used as given) for models
    of the given ``(dtype, head_dim)``; ``ValueError`` naming what does not fit."""
    if isinstance(choice, AttentionBackend):
        return choice
    if choice not in CHOICES:
        raise ValueError(f"attention_backend must be one of {', '.join(map(repr, CHOICES))} or an "
                         f"AttentionBackend, got {choice!r}")
    name = AUTO if choice == "auto" else choice
    if name == "torch":
        from mmkv.attention import native
        from mmkv.attention.torch_backend import TorchBackend

        if device.type == "cpu":
            native.kernel()  # build or load the decode kernel now, not in a first request's step
        return TorchBackend()
    from mmkv.attention.flashinfer_backend import FlashInferBackend, check_supported

    for dtype, head_dim in models:
        check_supported(device, dtype, head_dim)
    return FlashInferBackend(device)
