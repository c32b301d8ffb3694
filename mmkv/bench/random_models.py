"""Seeded random checkpoints for benchmarks, saved in Hugging Face layout to a directory."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.utils import logging as hf_logging

BENCH_LLAMA = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                   num_attention_heads=8, num_key_value_heads=4, vocab_size=8000,
                   max_position_embeddings=8192, initializer_range=0.1,
                   bos_token_id=None, eos_token_id=None, pad_token_id=None)


def text_size(hidden_size: int, num_layers: int) -> dict:
    """Overrides of ``BENCH_LLAMA`` for a text model of another width and depth (the tests run
    every benchmark on a small one)."""
    if (hidden_size, num_layers) == (BENCH_LLAMA["hidden_size"], BENCH_LLAMA["num_hidden_layers"]):
        return {}
    return dict(hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=num_layers)


def save_random_llama(directory: Path, seed: int = 0, **overrides) -> Path:
    """The benchmarks' Llama (hidden 512, 8 layers, 8 heads, 4 KV heads, vocab 8000)."""
    hf_logging.disable_progress_bar()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**{**BENCH_LLAMA, **overrides}))
    model.save_pretrained(directory)
    return directory


BENCH_MLLAMA_VISION = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                           num_global_layers=2, attention_heads=4, image_size=224, patch_size=14,
                           max_num_tiles=4, intermediate_layers_indices=[1, 3],
                           vision_output_dim=256 * 3, initializer_range=0.1)
MLLAMA_IMAGE_TOKEN = BENCH_LLAMA["vocab_size"]  # the id after the text vocabulary


def save_random_mllama(directory: Path, seed: int = 0, **text_overrides) -> Path:
    """A Mllama whose vision tower has hidden 256, 4 local + 2 global layers, 224-pixel tiles of
    14-pixel patches, and whose text model is the benchmarks' Llama with cross-attention at the
    last layer of each half (3 and 7; gates opened so the image matters)."""
    from transformers import MllamaConfig, MllamaForConditionalGeneration, MllamaImageProcessor

    hf_logging.disable_progress_bar()
    text = {k: v for k, v in {**BENCH_LLAMA, **text_overrides}.items() if not k.endswith("token_id")}
    layers = text["num_hidden_layers"]
    text.update(cross_attention_layers=[layers // 2 - 1, layers - 1], bos_token_id=1, eos_token_id=2,
                pad_token_id=3)
    config = MllamaConfig(vision_config=BENCH_MLLAMA_VISION, text_config=text,
                          image_token_index=MLLAMA_IMAGE_TOKEN)
    torch.manual_seed(seed)
    model = MllamaForConditionalGeneration(config)
    with torch.no_grad():
        for name, p in model.model.language_model.named_parameters():
            if name.endswith("_gate"):
                p.fill_(0.9)
    model.save_pretrained(directory)
    MllamaImageProcessor(size={"height": 224, "width": 224}, max_image_tiles=4).save_pretrained(directory)
    return directory


BENCH_QWEN2_5_VL_VISION = dict(depth=4, hidden_size=256, intermediate_size=1024, num_heads=4,
                               patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                               window_size=112, fullatt_block_indexes=[3], initializer_range=0.1)
QWEN_VL_TOKENS = dict(vision_start_token_id=7990, vision_end_token_id=7991, image_token_id=7992,
                      video_token_id=7993)


def save_random_qwen2_5_vl(directory: Path, seed: int = 0, **text_overrides) -> Path:
    """A Qwen2.5-VL whose text model is the benchmarks' Llama in size, with M-RoPE (a quarter of
    the rotary frequencies for T, three eighths each for H and W: 8/12/12 of 32), and whose vision
    tower has width 256, depth 4 (window attention, full attention in the last block), patch 14,
    merge 2; the special tokens are ids 7990-7993 (``QWEN_VL_TOKENS``) and the image processor's
    own defaults apply."""
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration,
                              Qwen2VLImageProcessor)

    hf_logging.disable_progress_bar()
    text = {**BENCH_LLAMA, **text_overrides}
    half = text["hidden_size"] // text["num_attention_heads"] // 2
    t = half // 4
    sections = [t, (half - t) // 2, half - t - (half - t) // 2]
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": sections}
    vision = {**BENCH_QWEN2_5_VL_VISION, "out_hidden_size": text["hidden_size"]}
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, initializer_range=0.1,
                              **QWEN_VL_TOKENS)
    torch.manual_seed(seed)
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(directory)
    Qwen2VLImageProcessor().save_pretrained(directory)
    return directory
