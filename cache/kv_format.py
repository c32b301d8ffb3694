"""How one cache layer stores K and V: the model's dtype, int8 with a scale per row, or fp8.

A *row* is one token's K (or V) for one KV head: ``head_dim`` values. The storage dtype of a layer
tensor says its format, so every reader and writer dispatches on ``layer.dtype`` alone:

* a float dtype (float32, bfloat16, float16): the values as they are;
* ``torch.int8``: symmetric per-row quantisation. A row is ``head_dim`` int8 codes followed by
  its scale as a bfloat16 (2 bytes), so a layer is ``[blocks, 2, block_size, kv_heads, head_dim
  + 2]`` int8 and every copy, swap, compaction or copy-on-write of a block moves the scales with
  the codes: they are the same bytes. The scale is the row's largest magnitude over 127, rounded
  *up* to bfloat16, and codes are ``round(x / scale)``; decoding is ``code * scale``. Per row (per
  token and KV head) rather than per channel: a block is written a token at a time, and a
  per-channel scale would change as tokens arrive (KIVI keeps a full-precision tail for that);
* ``torch.float8_e4m3fn``: the values cast to e4m3 (saturated at +-448), no scale of their own:
  FlashInfer's fp8 KV with its per-tensor ``k_scale`` / ``v_scale`` left at 1.

Guarantees: ``decode(encode(x))`` is within half a scale step of ``x`` for int8 (``|x - x'| <=
scale / 2`` per element, the scale the row stores) and within e4m3's rounding (3 mantissa bits,
relative ``2**-4``; ``2**-10`` absolute below its smallest normal) for fp8; float formats are
exact up to their own rounding. A row of zeros stays zeros.
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")
QUANTIZED = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
SCALE_DTYPE = torch.bfloat16  # the int8 rows' scale, stored after the codes
SCALE_BYTES = 2
INT8_MAX = 127.0
FP8_MAX = 448.0  # e4m3fn's largest finite value


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The layer tensors' dtype for an engine's ``kv_cache_dtype``; ``ValueError`` naming the
    choices for anything else."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in QUANTIZED:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}, "
                         f"got {kv_cache_dtype!r}")
    return QUANTIZED[kv_cache_dtype]


def row_width(dtype: torch.dtype, head_dim: int) -> int:
    """Elements of the layer tensor's last dimension that hold one row."""
    return head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim


def head_dim_of(layer: torch.Tensor) -> int:
    """The head size a layer tensor stores (its last dimension less the int8 rows' scale)."""
    return layer.shape[-1] - SCALE_BYTES if layer.dtype == torch.int8 else layer.shape[-1]


def check_head_dim(dtype: torch.dtype, head_dim: int) -> None:
    """int8 rows keep their scale aligned for a bfloat16 view: ``ValueError`` for an odd head size."""
    if dtype == torch.int8 and head_dim % 2:
        raise ValueError(f"kv_cache_dtype 'int8' needs an even head size, got {head_dim}")


def encode(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``[..., head_dim]`` (any float dtype) as a layer of ``dtype`` stores them
    (``[..., row_width]``)."""
    if dtype == torch.int8:
        wide = x.float()
        scale = _scale_of(wide.abs().amax(-1, keepdim=True))
        step = scale.float()
        codes = torch.where(step > 0, wide / torch.where(step > 0, step, 1.0), 0.0)
        codes = codes.round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
        return torch.cat((codes, scale.view(torch.int8)), -1)
    if dtype == torch.float8_e4m3fn:
        return x.float().clamp(-FP8_MAX, FP8_MAX).to(dtype)
    return x.to(dtype)


def decode(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Stored rows ``[..., row_width]`` as values ``[..., head_dim]`` of ``dtype``."""
    if rows.dtype == torch.int8:
        codes, scale = rows[..., :-SCALE_BYTES], rows[..., -SCALE_BYTES:]
        return (codes.to(dtype) * scale.contiguous().view(SCALE_DTYPE).to(dtype))
    return rows.to(dtype)


def scales(rows: torch.Tensor) -> torch.Tensor:
    """The scale of every int8 row ``[...]`` as float32."""
    return rows[..., -SCALE_BYTES:].contiguous().view(SCALE_DTYPE)[..., 0].float()


def _scale_of(largest: torch.Tensor) -> torch.Tensor:
    """The scale of rows whose largest magnitude is ``largest``: the least bfloat16 at or above
    ``largest / 127`` (worked in float64, where a bfloat16 times 127 is exact), so no code of the
    row's largest value rounds past 127, and positive for any nonzero row however small."""
    exact = largest.double()
    rounded = (exact / INT8_MAX).to(SCALE_DTYPE)
    low = rounded.double() * INT8_MAX < exact
    bits = rounded.view(torch.int16)
    return torch.where(low, bits + 1, bits).view(SCALE_DTYPE)  # the next bfloat16 up (all >= 0)
