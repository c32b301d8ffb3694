"""GGUF files for tests, written with the gguf package's own writer from a tiny Hugging Face model.

Each tensor is written as llama.cpp's converter lays it out (GGUF names; a Llama's Q and K rows
with each head's rotary halves interleaved) in the type ``kind_of(name)`` gives it. Q8_0, Q4_0,
Q4_1, Q5_0 and Q5_1 tensors are the model's weights quantized by ``gguf.quants``; the package has no
K-quant quantizer, so a Q4_K, Q5_K or Q6_K tensor is random blocks (every field drawn, float16
scales set so the weights' spread is the model's). The model such a file holds is whatever it
dequantizes to: transformers' ``from_pretrained(..., gguf_file=...)`` is the oracle, never the
Hugging Face model it was written from. The tokenizer is byte-level BPE (``gpt2``) with one token
per byte, so text prompts work, and the file carries a chat template (``CHAT_TEMPLATE``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T, GGUFWriter, quants
from transformers import AutoModelForCausalLM
from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

K_QUANTS = (T.Q4_K, T.Q5_K, T.Q6_K)
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")
HALF_FIELDS = {  # byte offsets of each block type's float16 fields (the rest are codes and sub-scales)
    T.Q8_0: (0,), T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2),
    T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
}


def raw_blocks(kind: T, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Every byte random but the float16 scale fields (random finite values of either sign)."""
    rng = np.random.default_rng(seed)
    block_weights, block_bytes = GGML_QUANT_SIZES[kind]
    data = rng.integers(0, 256, size=(rows, cols // block_weights, block_bytes), dtype=np.uint8)
    for at in HALF_FIELDS.get(kind, ()):
        values = rng.uniform(-0.05, 0.05, size=(*data.shape[:2], 1)).astype(np.float16)
        data[..., at:at + 2] = values.view(np.uint8)
    return data.reshape(rows, -1)


def random_blocks(kind: T, rows: int, cols: int, rng: np.random.Generator,
                  spread: float = 0.1) -> np.ndarray:
    """``[rows, bytes]`` of random ``kind`` blocks: every byte drawn, then the float16 fields set
    positive and scaled so the dequantized weights' standard deviation is about ``spread``."""
    block_weights, block_bytes = GGML_QUANT_SIZES[kind]
    data = rng.integers(0, 256, size=(rows, cols // block_weights, block_bytes), dtype=np.uint8)
    fields = HALF_FIELDS[kind]
    values = rng.uniform(0.5, 1.0, size=(*data.shape[:2], len(fields))).astype(np.float16)
    for j, at in enumerate(fields):
        data[..., at:at + 2] = np.ascontiguousarray(values[..., j:j + 1]).view(np.uint8)
    std = float(quants.dequantize(data.reshape(rows, -1), kind).std()) or 1.0
    values = (values.astype(np.float32) * spread / std).astype(np.float16)
    for j, at in enumerate(fields):
        data[..., at:at + 2] = np.ascontiguousarray(values[..., j:j + 1]).view(np.uint8)
    return data.reshape(rows, -1)


def interleave_rotary(weight: np.ndarray, heads: int) -> np.ndarray:
    """A Llama Q or K projection's rows as llama.cpp's converter stores them: within each head,
    the first and second rotary halves interleaved."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def byte_tokens() -> list[str]:
    """GPT-2's byte-level alphabet: each of the 256 bytes as the character that stands for it."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def write_gguf(hf_dir: Path, path: Path, kind_of, architecture: str | None = None,
               seed: int = 0, name: str = "tiny") -> Path:
    """Write the model in ``hf_dir`` (vocabulary of at least 256) to ``path``, each tensor of GGUF
    name ``n`` in type ``kind_of(n)`` (the module docstring); ``architecture`` overrides the
    file's (to write one mmkv refuses)."""
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    config = model.config
    arch = architecture or config.model_type.replace("mistral", "llama")
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), arch)
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    tokens = byte_tokens() + [f"<extra_{i}>" for i in range(config.vocab_size - 256)]
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 256 + [4] * (config.vocab_size - 256))
    writer.add_token_scores([0.0] * config.vocab_size)
    writer.add_token_merges([])
    writer.add_bos_token_id(256 if config.vocab_size > 256 else 0)
    writer.add_eos_token_id(257 if config.vocab_size > 257 else 0)
    writer.add_chat_template(CHAT_TEMPLATE)
    names = {hf: gguf for gguf, hf in get_gguf_hf_weights_map(model, TensorProcessor()).items()}
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    state = model.state_dict()
    for hf_name, tensor in state.items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        gguf_name = names[hf_name]
        value = tensor.numpy()
        role = gguf_name.split(".")[-2]
        if arch == "llama" and role in heads:
            value = interleave_rotary(value, heads[role])
        kind = kind_of(gguf_name) if value.ndim == 2 else T.F32
        if kind in (T.F32, T.F16):
            writer.add_tensor(gguf_name, value.astype(np.float32 if kind == T.F32 else np.float16))
        elif kind in K_QUANTS:
            data = random_blocks(kind, value.shape[0], value.shape[1], rng, float(value.std()))
            writer.add_tensor(gguf_name, data, raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name, quants.quantize(value, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def mixed_kinds(name: str) -> T:
    """Every supported type in one model, as a Q4_K_M file mixes them: K-quants for the
    attention and MLP, Q6_K for V and the head, legacy quants besides, and two F16 layers (one
    beside a quantized layer of the same input)."""
    table = {"attn_q": T.Q4_K, "attn_k": T.Q5_K, "attn_v": T.Q6_K, "attn_output": T.Q8_0,
             "ffn_gate": T.Q4_0, "ffn_up": T.Q4_1, "ffn_down": T.Q5_0, "token_embd": T.Q4_K,
             "output": T.Q6_K}
    role = name.split(".")[-2]
    if role == "ffn_down" and name.startswith("blk.1."):
        return T.Q5_1
    if role in ("attn_output", "ffn_up") and name.startswith("blk.1."):
        return T.F16
    return table.get(role, T.F32)
