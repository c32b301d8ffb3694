"""How an engine picks its attention backend (the contract every backend keeps is
``mmkv.step_context.AttentionBackend``)."""

from __future__ import annotations

from typing import Collection

import torch

from mmkv.step_context import AttentionBackend

CHOICES = ("auto", "torch", "flashinfer")
# What "auto" picks, on every device, until the FlashInfer backend has passed its GPU checks
# (tests/gpu/run_device_checks.sh) on real hardware; until then "flashinfer" is opt-in.
AUTO = "torch"


def choose_backend(choice: str | AttentionBackend, device: torch.device,
                   models: list[tuple[torch.dtype, int]],
                   kv_dtypes: Collection[torch.dtype] = ()) -> AttentionBackend:
    """The backend an engine asked for with ``choice`` (an instance is used as given) for models
    of the given ``(dtype, head_dim)`` over cache layers of ``kv_dtypes``; ``ValueError`` naming
    what does not fit."""
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
        check_supported(device, dtype, head_dim, kv_dtypes)
    return FlashInferBackend(device)
