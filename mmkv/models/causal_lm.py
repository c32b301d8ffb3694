"""Decoder-only language models: Llama, Qwen2 and Mistral (GQA, tied or untied embeddings, RoPE
scaling and sliding windows as configured)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from mmkv.models.base import (ATTENTION_NAME, ModelAdapter, ModelLoadError, load_hf_config,
                              resolve_dtype)
from mmkv.quantization import Quantization
from mmkv.quantization.loading import finish_loading, loading_arguments

TEXT_FAMILIES = ("llama", "qwen2", "mistral")


def from_pretrained(cls, path: Path, dtype: torch.dtype, attn_implementation,
                    quantization: Quantization | None = None):
    """``cls.from_pretrained`` with load failures reported as ``ModelLoadError``; with
    ``quantization``, its layers quantized as they load (``mmkv.quantization.loading``)."""
    try:
        model = cls.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation,
                                    **loading_arguments(quantization))
        if quantization is not None:
            finish_loading(model)
    except (OSError, ValueError, RuntimeError, KeyError) as err:
        raise ModelLoadError(f"cannot load weights from {str(path)!r}: {err}") from err
    return model


def load_causal_lm(path: Path, device: torch.device, dtype: str | torch.dtype,
                   quantization: Quantization | None = None) -> ModelAdapter:
    config = load_hf_config(path)
    dtype = resolve_dtype(dtype, config.dtype, device)
    model = from_pretrained(AutoModelForCausalLM, path, dtype, ATTENTION_NAME, quantization)
    return ModelAdapter(model=model, text_model=model.model, lm_head=model.lm_head,
                        text_config=model.config, device=device, dtype=dtype,
                        quantization=quantization)
