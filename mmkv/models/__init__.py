"""Model families mmkv serves, chosen by ``model_type`` in the directory's config.json, or by
the architecture a GGUF file names (``mmkv.models.gguf_lm``)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

from mmkv.models.base import (ATTENTION_NAME, ImagePlacement, ModelAdapter, ModelLoadError,
                              read_config_json, resolve_device)
from mmkv.models.causal_lm import TEXT_FAMILIES, load_causal_lm
from mmkv.models.cross_attention import CrossAttentionAdapter, load_mllama
from mmkv.models.gguf_lm import gguf_file, load_gguf_lm
from mmkv.models.llava import LlavaAdapter, load_llava
from mmkv.models.mmkv_vlm import MODEL_TYPE as MMKV_VLM, MmkvVLM, load_mmkv_vlm
from mmkv.models.mrope import MRopePositions
from mmkv.models.qwen_vl import QWEN_VL_FAMILIES, QwenVLAdapter, load_qwen_vl
from mmkv.quantization import Quantization

FAMILIES = (*TEXT_FAMILIES, "llava", "mllama", *QWEN_VL_FAMILIES, MMKV_VLM)


def load_model(path: str | Path, device: torch.device, dtype: str | torch.dtype,
               quantization: Quantization | None = None) -> ModelAdapter:
    """Load the model in ``path`` (Hugging Face layout, or a GGUF file) for ``device``, its
    linear layers quantized as ``quantization`` says (``mmkv.quantization``; a GGUF file's are
    quantized already, so it takes none); ``ModelLoadError`` when the directory is missing,
    corrupt or of a family mmkv does not serve."""
    path = Path(path)
    if (file := gguf_file(path)) is not None:
        if quantization is not None:
            raise ValueError(f"{file.name} is quantized already (GGUF); load it without quantization")
        return load_gguf_lm(file, device, dtype)
    raw = read_config_json(path)
    family = raw["model_type"]
    hf_logging.disable_progress_bar()
    if family in TEXT_FAMILIES:
        return load_causal_lm(path, device, dtype, quantization)
    if family == "llava":
        return load_llava(path, device, dtype, quantization)
    if family == "mllama":
        return load_mllama(path, device, dtype, quantization)
    if family in QWEN_VL_FAMILIES:
        return load_qwen_vl(path, family, device, dtype, quantization)
    if family == MMKV_VLM:
        return load_mmkv_vlm(path, raw, device, dtype, quantization)
    raise ModelLoadError(f"model type {family!r} is not supported; supported: {', '.join(FAMILIES)}")


__all__ = ["ATTENTION_NAME", "CrossAttentionAdapter", "FAMILIES", "ImagePlacement",
           "LlavaAdapter", "ModelAdapter", "ModelLoadError", "MmkvVLM", "MRopePositions",
           "QwenVLAdapter", "load_model", "resolve_device"]
