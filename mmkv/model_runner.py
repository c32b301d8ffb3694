"""Loads a Hugging Face causal LM from a local directory and runs it over the paged KV cache.

mmkv drives transformers' own modules (embeddings, decoder layers, norms, rotary embedding, LM
head), so every operation but attention is the checkpoint's reference implementation; attention is
mmkv's, plugged in through transformers' ``AttentionInterface``. A step runs all scheduled tokens
of all sequences as one packed row (``[1, total_tokens]``) with explicit positions; the paged
metadata tells attention where each sequence's KV lives.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.utils import logging as hf_logging

from cache import KVLayout
from mmkv.attention import torch_backend
from mmkv.attention.metadata import PagedBatch

ATTENTION_NAME = "mmkv_paged"
TEXT_FAMILIES = ("llama", "qwen2", "mistral")


class ModelLoadError(ValueError):
    """The model directory is missing, incomplete, corrupt or of an unsupported family."""


@dataclass(slots=True)
class StepContext:
    """What mmkv's attention needs during one forward step (passed down as a keyword argument)."""

    batch: PagedBatch
    kv_layers: list[torch.Tensor]


def _paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: torch.Tensor | None,
                     scaling: float | None = None, sliding_window: int | None = None,
                     mmkv_step: StepContext | None = None, **_: object):
    """transformers attention hook: write this step's K/V into the pages, attend over the pages."""
    if mmkv_step is None:
        raise RuntimeError("mmkv's paged attention runs only inside an mmkv engine step")
    layer = mmkv_step.kv_layers[module.layer_idx]
    q = query[0].transpose(0, 1)  # [T, heads, head_dim]
    torch_backend.write_kv(layer, mmkv_step.batch, key[0].transpose(0, 1), value[0].transpose(0, 1))
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = torch_backend.attention(q, layer, mmkv_step.batch, scale, sliding_window)
    return out[None], None


AttentionInterface.register(ATTENTION_NAME, _paged_attention)


def load_config(path: str | Path) -> PretrainedConfig:
    """The checkpoint's config, or ``ModelLoadError`` saying what is wrong with the directory."""
    root = Path(path)
    if not root.is_dir():
        raise ModelLoadError(f"model directory {str(path)!r} does not exist")
    config_file = root / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"model directory {str(path)!r} has no config.json")
    try:
        json.loads(config_file.read_text())
        return AutoConfig.from_pretrained(root)
    except (ValueError, KeyError, TypeError) as err:
        raise ModelLoadError(f"{config_file} is not a valid model config: {err}") from err


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, config: PretrainedConfig, device: torch.device) -> torch.dtype:
    """``auto``: fp32 on CPU, the checkpoint's dtype on GPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        return getattr(torch, stored) if isinstance(stored, str) else (stored or torch.float32)
    if not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise ValueError(f"dtype must be 'auto' or a torch dtype name such as 'float32', got {dtype!r}")
    return getattr(torch, dtype)


class ModelRunner:
    """One causal LM, loaded from a local directory, run over mmkv's paged KV cache.

    Guarantees: ``forward`` returns the logits transformers would compute for the same tokens at
    the same positions with the same preceding context.
    """

    def __init__(self, path: str | Path, device: torch.device, dtype: str | torch.dtype) -> None:
        config = load_config(path)
        if config.model_type not in TEXT_FAMILIES:
            raise ModelLoadError(f"model type {config.model_type!r} is not supported; "
                                 f"supported: {', '.join(TEXT_FAMILIES)}")
        self.device = device
        self.dtype = resolve_dtype(dtype, config, device)
        hf_logging.disable_progress_bar()
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype,
                                                         attn_implementation=ATTENTION_NAME)
        except (OSError, ValueError, RuntimeError) as err:
            raise ModelLoadError(f"cannot load weights from {str(path)!r}: {err}") from err
        self.model = model.to(device).eval()
        self.config = model.config
        self.sliding_window: int | None = getattr(self.config, "sliding_window", None)
        self.max_model_len: int = self.config.max_position_embeddings
        self.num_parameters = sum(p.numel() for p in self.model.parameters())

    def kv_layout(self, block_size: int) -> KVLayout:
        c = self.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return KVLayout(num_layers=c.num_hidden_layers, num_kv_heads=c.num_key_value_heads,
                        head_dim=head_dim, block_size=block_size, dtype=self.dtype)

    def cascade_allowed(self, max_kv_len: int) -> bool:
        """Shared-prefix attention is exact only when no sliding window cuts into a sequence."""
        return self.sliding_window is None or max_kv_len <= self.sliding_window

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, batch: PagedBatch, kv_layers: list[torch.Tensor],
                logit_rows: torch.Tensor) -> torch.Tensor:
        """Run the packed tokens through the model; float32 logits of the rows in ``logit_rows``."""
        inner = self.model.model
        hidden = inner.embed_tokens(input_ids[None])
        positions = batch.positions[None]
        rotary = inner.rotary_emb(hidden, position_ids=positions)
        step = StepContext(batch, kv_layers)
        for layer in inner.layers:
            hidden = layer(hidden, position_embeddings=rotary, position_ids=positions, mmkv_step=step)
        hidden = inner.norm(hidden[0, logit_rows])
        return self.model.lm_head(hidden).float()
