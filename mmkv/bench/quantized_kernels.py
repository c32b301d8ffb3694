"""Layer-level times of quantized weights: for each GEMM shape of a Llama layer and several row
counts, the ways a quantized layer can run bfloat16 rows (native or dense, each in bfloat16 or
float32 arithmetic: ``mmkv.quantization.linear``), beside the unquantized bfloat16 layer. What
``mmkv.quantization.linear.NATIVE_ROWS`` was chosen from (``python -m mmkv.bench weights
--kernels``).

Each way runs over ``LAYERS`` distinct weights of the shape in turn, as a model's steps do, so a
weight comes from memory, not from the cache its previous call left it in (a weight of a few MiB
would otherwise stay cached and make every way compute-bound). A figure is the milliseconds of one
layer call: the fastest pass over all of them, divided by their number.
"""

from __future__ import annotations

import time

import torch

from mmkv.models.packed_linear import PackedLinear
from mmkv.quantization import Quantization, QuantizedLinear, quantize
from mmkv.quantization.linear import BFLOAT16_WAYS

ROWS = (1, 4, 16, 32, 64, 512)
LAYERS = 8  # distinct weights per shape: more bytes than a CPU's last-level cache holds


def per_layer_ms(layers: list, call, passes: int = 3) -> float:
    call(layers[0])
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        for layer in layers:
            call(layer)
        best = min(best, time.perf_counter() - start)
    return round(best / len(layers) * 1e3, 3)


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
        weights = [torch.randn(rows_out, rows_in) * 0.02 for _ in range(LAYERS)]
        ways = {"bf16_packed": [PackedLinear(w.bfloat16(), None) for w in weights]}
        for method in ("int8", "int4"):
            ways[method] = [QuantizedLinear(quantize(w, Quantization(method)), None) for w in weights]
        del weights
        for rows in ROWS:
            x = torch.randn(rows, rows_in).bfloat16()
            tag = f"{rows_out}x{rows_in}_r{rows}"
            out[f"kernel_bf16_packed_{tag}"] = per_layer_ms(ways["bf16_packed"], lambda layer: layer(x))
            for method in ("int8", "int4"):
                layers = ways[method]
                for way in BFLOAT16_WAYS:  # kernel_int4_native_bfloat16_..., ..._dense_float32_...
                    if layers[0].kernels is not None:
                        out[f"kernel_{method}_native_{way}_{tag}"] = per_layer_ms(
                            layers, lambda layer: layer.native(x, way))
                    out[f"kernel_{method}_dense_{way}_{tag}"] = per_layer_ms(
                        layers, lambda layer: layer.dense(x, way))
            out[f"kernel_int8_torch_int8pack_{tag}"] = per_layer_ms(
                ways["int8"], lambda layer: torch._weight_int8pack_mm(
                    x, layer.weight.codes, layer.weight.scale.bfloat16()))
    return out
