"""Decoder-only language models: Llama, Qwen2 and Mistral (GQA, tied or untied embeddings, RoPE
scaling and sliding windows as configured)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from mmkv.models.base import (ATTENTION_NAME, ModelAdapter, ModelLoadError, load_hf_config,
                              resolve_dtype)
from mmkv.quantization import Quantization, QuantizedLinearModule
from mmkv.quantization.checkpoints import checkpoint_arguments, repack_loaded
from mmkv.quantization.loading import finish_loading, loading_arguments

TEXT_FAMILIES = ("llama", "qwen2", "mistral")


def from_pretrained(cls, path: Path, dtype: torch.dtype, attn_implementation,
                    quantization: Quantization | None = None):
    """``cls.from_pretrained`` with load failures reported as ``ModelLoadError``; with
    ``quantization``, its layers quantized as they load (``mmkv.quantization.loading``); a
    checkpoint quantized by AWQ, GPTQ or compressed-tensors repacked into mmkv's layouts
    (``mmkv.quantization.checkpoints``; ``model.mmkv_weights_format`` says which)."""
    try:
        arguments = checkpoint_arguments(path, quantization) or loading_arguments(quantization)
        model = cls.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation, **arguments)
        form = getattr(arguments.get("quantization_config"), "form", None)
        if form is not None:
            repack_loaded(model)
            model.mmkv_weights_format = form.describe()
        if quantization is not None or form is not None:
            finish_loading(model)
    except (OSError, ValueError, RuntimeError, KeyError) as err:
        raise ModelLoadError(f"cannot load weights from {str(path)!r}: {err}") from err
    detach_from_file(model)
    return model


def detach_from_file(model: torch.nn.Module) -> None:
    """Give the CPU parameters and buffers that transformers left as views of the memory-mapped
    checkpoint memory of their own, one at a time, so the mapping and its resident pages go when
    loading ends (else the file's pages stay resident beside the packed or quantized copies made
    from them). A quantized layer's tensors are its own already."""
    quantized = {id(t) for m in model.modules() if isinstance(m, QuantizedLinearModule)
                 for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))}
    for tensor in (*model.parameters(), *model.buffers()):
        if tensor.device.type == "cpu" and tensor.numel() and id(tensor) not in quantized:
            tensor.data = tensor.data.clone()


def load_causal_lm(path: Path, device: torch.device, dtype: str | torch.dtype,
                   quantization: Quantization | None = None) -> ModelAdapter:
    config = load_hf_config(path)
    dtype = resolve_dtype(dtype, config.dtype, device)
    model = from_pretrained(AutoModelForCausalLM, path, dtype, ATTENTION_NAME, quantization)
    return ModelAdapter(model=model, text_model=model.model, lm_head=model.lm_head,
                        text_config=model.config, device=device, dtype=dtype,
                        quantization=quantization)
