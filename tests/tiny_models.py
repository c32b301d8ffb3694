"""Tiny random checkpoints in Hugging Face layout, built locally with a fixed seed."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config,
                          PreTrainedTokenizerFast)
from transformers.utils import logging as hf_logging

from speculative.controller import Settings

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=256, max_position_embeddings=512,
              initializer_range=0.15, bos_token_id=None, eos_token_id=None, pad_token_id=None)

# Each family's config from COMMON and the given fields; fields are set at construction, so
# derived ones (head_dim from hidden_size and num_attention_heads) follow them.
FAMILIES = {
    "llama": lambda **kw: LlamaConfig(**{**COMMON, "tie_word_embeddings": False, **kw}),
    "qwen2": lambda **kw: Qwen2Config(**{**COMMON, "tie_word_embeddings": True, **kw}),
    "mistral": lambda **kw: MistralConfig(
        **{**COMMON, "sliding_window": 24, "tie_word_embeddings": False, **kw}),
    "llama_rope_scaled": lambda **kw: LlamaConfig(**{
        **COMMON, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        **kw}),
}

# Speculation that learns its pass costs from its first rounds, which therefore run (explore)
# whether or not a round could pay on these tiny models: tests of the rounds' exactness use it,
# whatever the default (calibrated at start, an engine drafts nothing where a draft that is always
# right would not pay).
LEARNING = Settings(calibrate=0)


def build_model(family: str, directory: Path, seed: int = 0, **overrides) -> Path:
    """Save a seeded random model of ``family`` into ``directory``; returns the directory."""
    hf_logging.disable_progress_bar()
    config = FAMILIES[family](**overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # transformers starts biases (Qwen2's Q/K/V) at zero, which hides their use
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, config.initializer_range)
    model.save_pretrained(directory)
    return directory


def save_byte_tokenizer(directory: Path) -> None:
    """A character-level tokenizer (id = code point, 0..255) so string prompts work on tiny models."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {chr(i): i for i in range(256)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=chr(0)))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(directory)


def load_hf(directory: Path):
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The oracle: transformers' generate, greedy, fp32, never stopping early."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                         min_new_tokens=max_new_tokens)
    return out[0, len(prompt):].tolist()


def captured_logits(engine, requests, params) -> list[torch.Tensor]:
    """The logits every step of ``engine.generate(requests, params)`` computed, in step order."""
    logits = []
    forward = engine.model.forward

    def spy(input_ids, step, rows):
        out = forward(input_ids, step, rows)
        logits.append(out.clone())
        return out

    engine.model.forward = spy
    try:
        engine.generate(requests, params)
    finally:
        del engine.model.forward
    return logits
