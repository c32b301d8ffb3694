"""Layer-level times of quantized weights: for each GEMM shape of a Llama layer and several row
counts, the ways a quantized layer can run, beside the unquantized bfloat16 layer. What
``mmkv.quantization.linear.NATIVE_ROWS`` was chosen from (``python -m mmkv.bench weights
--kernels``)."""

from __future__ import annotations

import time

import torch

from mmkv.models.packed_linear import PackedLinear
from mmkv.quantization import Quantization, QuantizedLinear, quantize

ROWS = (1, 4, 16, 32, 64, 128, 512)


def fastest_ms(fn, turns: int = 5) -> float:
    fn()
    times = []
    for _ in range(turns):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(min(times) * 1e3, 3)


def shapes(config: dict) -> dict[str, tuple[int, int]]:
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    kv = hidden // config["num_attention_heads"] * config["num_key_value_heads"]
    return {"qkv": (hidden + 2 * kv, hidden), "o": (hidden, hidden), "gate_up": (2 * inter, hidden),
            "down": (hidden, inter)}


@torch.inference_mode()
def kernel_times(config: dict) -> dict[str, float]:
    """Milliseconds per way, shape and row count (the module docstring), bfloat16 rows."""
    out = {}
    torch.manual_seed(0)
    for (rows_out, rows_in) in shapes(config).values():
        w = torch.randn(rows_out, rows_in) * 0.02
        bf16 = PackedLinear(w.bfloat16(), None)
        layers = {m: QuantizedLinear(quantize(w, Quantization(m)), None) for m in ("int8", "int4")}
        int8 = layers["int8"].weight
        for rows in ROWS:
            x = torch.randn(rows, rows_in).bfloat16()
            tag = f"{rows_out}x{rows_in}_r{rows}"
            out[f"kernel_bf16_packed_{tag}"] = fastest_ms(lambda: bf16(x))
            for method, layer in layers.items():
                if layer.kernels is not None:
                    out[f"kernel_{method}_native_{tag}"] = fastest_ms(lambda: layer.native(x))
                out[f"kernel_{method}_dense_{tag}"] = fastest_ms(lambda: layer.dense(x))
            out[f"kernel_int8_torch_int8pack_{tag}"] = fastest_ms(
                lambda: torch._weight_int8pack_mm(x, int8.codes, int8.scale.bfloat16()))
    return out
