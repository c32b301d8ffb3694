"""Seeded random checkpoints for benchmarks, saved in Hugging Face layout to a directory."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.utils import logging as hf_logging

BENCH_LLAMA = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                   num_attention_heads=8, num_key_value_heads=4, vocab_size=8000,
                   max_position_embeddings=4096, initializer_range=0.1,
                   bos_token_id=None, eos_token_id=None, pad_token_id=None)


def save_random_llama(directory: Path, seed: int = 0, **overrides) -> Path:
    """The benchmarks' Llama (hidden 512, 8 layers, 8 heads, 4 KV heads, vocab 8000)."""
    hf_logging.disable_progress_bar()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**{**BENCH_LLAMA, **overrides}))
    model.save_pretrained(directory)
    return directory
