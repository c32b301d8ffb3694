"""Hugging Face checkpoints in AWQ, GPTQ and compressed-tensors layouts, written from known codes.

``quantize_checkpoint(source, target, method, ...)`` draws, for every quantized linear layer of a
saved model (the decoder layers' projections; never the vision tower), integer codes, zero points
and float16 scales, and writes them packed as the format documents it (AWQ's GEMM layout with its
interleaved word order, GPTQ's ``qweight``/``qzeros``/``scales``/``g_idx``, compressed-tensors by
the ``compressed_tensors`` library itself), with a ``quantization_config`` in config.json. It
returns the dequantized weights ``(q - z) s`` by module path: the oracle model is the source model
with those weights (``dequantized_model``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def pack(values: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    """Non-negative ``values`` ``[rows, n * per]`` as int32 words ``[rows, n]``, ``per = 32 / bits``
    a word: word ``c`` holds value ``c * per + order[j]`` in bits ``bits * j`` (``order``: 0, 1, ...)."""
    per = 32 // bits
    order = order or tuple(range(per))
    v = values.long().reshape(values.shape[0], -1, per)
    words = sum(v[..., order[j]] << (bits * j) for j in range(per))
    return (words - (words >= 2 ** 31).long() * 2 ** 32).to(torch.int32).contiguous()


def quantized_keys(state: dict) -> list[str]:
    """The checkpoint keys of the linear weights a format quantizes: the decoder layers'
    projections (attention and MLP), never a vision tower's."""
    return [k for k in state if k.endswith("_proj.weight") and ".layers." in k
            and "visual" not in k and "vision" not in k]


def draw(out: int, in_: int, bits: int, group: int, generator, zero_range) -> tuple:
    groups = in_ // group
    codes = torch.randint(0, 2 ** bits, (out, in_), generator=generator)
    zeros = torch.randint(*zero_range, (out, groups), generator=generator)
    scales = (torch.rand(out, groups, generator=generator) * 0.02 + 0.005).half()
    weight = (codes - zeros.repeat_interleave(group, 1)).float() * scales.float().repeat_interleave(group, 1)
    return codes, zeros, scales, weight


def quantize_checkpoint(source: Path, target: Path, method: str, bits: int = 4, group: int = 32,
                        symmetric: bool = False, seed: int = 0, gptq_format: str = "gptq",
                        act_order: bool = False) -> dict[str, torch.Tensor]:
    """Write ``source``'s model to ``target`` quantized by ``method`` (``awq`` or ``gptq``) from
    drawn codes; returns each quantized layer's dequantized weight by checkpoint key."""
    generator = torch.Generator().manual_seed(seed)
    shutil.copytree(source, target)
    state = load_file(target / "model.safetensors")
    half = 2 ** (bits - 1)
    weights = {}
    for key in quantized_keys(state):
        out, in_ = state.pop(key).shape
        zero_range = (half, half + 1) if symmetric else ((1, 2 ** bits) if method == "gptq" else (0, 2 ** bits))
        codes, zeros, scales, weights[key] = draw(out, in_, bits, group, generator, zero_range)
        prefix = key.removesuffix(".weight")
        if method == "awq":
            state[f"{prefix}.qweight"] = pack(codes.T, bits, AWQ_ORDER)
            state[f"{prefix}.qzeros"] = pack(zeros.T, bits, AWQ_ORDER)
            state[f"{prefix}.scales"] = scales.T.contiguous()
        else:
            stored = zeros - int(gptq_format == "gptq")
            state[f"{prefix}.qweight"] = pack(codes, bits).T.contiguous()
            state[f"{prefix}.qzeros"] = pack(stored.T, bits)
            state[f"{prefix}.scales"] = scales.T.contiguous()
            g_idx = torch.arange(in_) // group
            state[f"{prefix}.g_idx"] = (g_idx.flip(0) if act_order else g_idx).to(torch.int32)
    save_file(state, target / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    if method == "awq":
        settings = {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True,
                    "version": "gemm", "modules_to_not_convert": ["visual"]}
    else:
        settings = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order,
                    "sym": symmetric, "checkpoint_format": gptq_format}
    config["quantization_config"] = settings
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return weights


def compressed_tensors_checkpoint(source: Path, target: Path, bits: int = 4, group: int = 32,
                                  symmetric: bool = True, seed: int = 0) -> dict[str, torch.Tensor]:
    """``source`` quantized by the ``compressed_tensors`` library (``pack-quantized``, weights only,
    ``strategy: group``) from drawn codes; the dequantized weights by module path."""
    from compressed_tensors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig,
                                                 QuantizationScheme, QuantizationStatus,
                                                 apply_quantization_config)
    from transformers import AutoModelForCausalLM

    generator = torch.Generator().manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy="group", group_size=group)
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)}, ignore=["lm_head"]))
    half = 2 ** (bits - 1)
    weights = {}
    for name, module in model.named_modules():
        if hasattr(module, "weight_scale"):
            out, in_ = module.weight.shape
            zero_range = (half, half + 1) if symmetric else (0, 2 ** bits)
            codes, zeros, scales, weight = draw(out, in_, bits, group, generator, zero_range)
            module.weight_scale.data = scales.float()
            module.weight_zero_point.data = (zeros - half).to(module.weight_zero_point.dtype)
            module.weight.data = weight
            module.quantization_status = QuantizationStatus.FROZEN
            weights[f"{name}.weight"] = weight
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(target)
    compressor.update_config(target)
    for extra in source.iterdir():  # tokenizer files
        if not (target / extra.name).exists():
            shutil.copy(extra, target / extra.name)
    return weights


def dequantized_model(cls, source: Path, weights: dict[str, torch.Tensor]):
    """The oracle: ``source``'s model with each quantized layer's weight replaced by its
    dequantized value (matched by the checkpoint key's module path)."""
    model = cls.from_pretrained(source, dtype=torch.float32).eval()
    modules = dict(model.named_modules())
    for key, weight in weights.items():
        name = key.removesuffix(".weight")
        module = modules.get(name) or next(m for n, m in modules.items() if n.endswith(name.removeprefix("model.")))
        module.weight.data = weight.clone()
    return model
