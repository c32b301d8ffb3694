"""GGUF tensors repacked into mmkv's quantized layouts, bit for bit the weights llama.cpp's
format defines (``gguf``'s ``dequantize`` is the oracle).

A GGUF row of ``cols`` weights is a run of blocks; each block type maps onto a layout of
``mmkv.quantization.formats`` without loss:

=========  ==========================================  =========================================
type       block (weights, what it stores)             mmkv layout
=========  ==========================================  =========================================
Q4_0       32: d, 4-bit q; ``w = d (q - 8)``             int4, group 32: scale d, offset d x -8
                                                        (the same d)
Q4_1       32: d, m, 4-bit q; ``w = d q + m``            int4, group 32: scale d, offset m
Q5_0       32: d, 5-bit q; ``w = d (q - 16)``            int8 groups of 32: codes q - 16, scale d
Q5_1       32: d, m, 5-bit q; ``w = d q + m``            int8 groups of 32: scale d, offset m
Q8_0       32: d, int8 q; ``w = d q``                    int8 groups of 32: scale d
Q4_K       256: d, dmin, eight 6-bit (sc, m) pairs,       int4, group 32, both in two levels:
           4-bit q; ``w = d sc q - dmin m``              scale d x sc, offset (-dmin) x m
Q5_K       256: as Q4_K with 5-bit q                     int8 groups of 32, two levels, as Q4_K
Q6_K       256: d, sixteen int8 sc, 6-bit q;             int8 groups of 16: codes q - 32,
           ``w = d sc (q - 32)``                          scale d x sc (two levels)
=========  ==========================================  =========================================

Every value above is float16 in the file and stays float16 (x: two levels, ``formats``'s group
values); products are taken in float32, where they are exact, so the dequantized weight equals
``gguf.quants.dequantize``'s. A 4-bit tensor takes the file's bytes plus at most one byte per
group; a 5- or 6-bit one a byte a weight. Rows are repacked ``CHUNK_ELEMENTS`` weights at a time
into tensors made once, so a tensor's temporaries stay a few MiB. F32, F16 and BF16 tensors are
read as they are. Any other type (IQ quants, Q2_K, Q3_K, ...) is a ``ValueError`` naming it.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T, quants

from mmkv.quantization.formats import CHUNK_ELEMENTS, Int4Weight, Int8GroupWeight, QuantizedWeight

FLOAT_TYPES = {T.F32: np.float32, T.F16: np.float16, T.BF16: None}
QUANTIZED_TYPES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K)
SUPPORTED_TYPES = (*FLOAT_TYPES, *QUANTIZED_TYPES)


def check_type(kind: T, name: str) -> None:
    """``ValueError`` naming the tensor and its type unless mmkv loads that type."""
    if kind not in SUPPORTED_TYPES:
        raise ValueError(f"GGUF tensor {name!r} has type {kind.name}, which mmkv does not load; "
                         f"supported: {', '.join(t.name for t in SUPPORTED_TYPES)}")


def _half(blocks: np.ndarray, start: int) -> torch.Tensor:
    """The float16 at byte ``start`` of every block ``[rows, blocks, bytes]``, ``[rows, blocks]``."""
    return torch.from_numpy(np.ascontiguousarray(blocks[..., start:start + 2]).view(np.float16)[..., 0])


def _int8(values: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(values).astype(np.int8))


def _packed_int4(codes: np.ndarray) -> torch.Tensor:
    """Codes 0-15 ``[rows, cols]`` two per byte as mmkv packs them (input 2j low, 2j + 1 high)."""
    pairs = codes.astype(np.uint8).reshape(codes.shape[0], -1, 2)
    return torch.from_numpy(pairs[..., 0] | (pairs[..., 1] << 4))


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Bytes ``[..., n]`` as their low nibbles then their high ones, ``[..., 2n]``."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _fifth_bits(qh: np.ndarray, weights: int) -> np.ndarray:
    """Bit j of the little-endian words ``qh`` ``[..., 4]``, for j < ``weights``: ``[..., weights]``."""
    word = np.ascontiguousarray(qh).view("<u4")
    return ((word >> np.arange(weights, dtype=np.uint32)) & 1).astype(np.uint8)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A K-quant block's twelve scale bytes ``[..., 12]`` as its eight 6-bit sub-block scales and
    eight 6-bit minima: bytes 0-3 hold scales 0-3 (low six bits) and the top bits of scales 4-7,
    bytes 4-7 minima 0-3 and the top bits of minima 4-7, bytes 8-11 the low four bits of scales
    4-7 (low nibble) and of minima 4-7 (high nibble)."""
    low_scales, low_mins, rest = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([low_scales & 0x3F, (rest & 0x0F) | ((low_scales >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([low_mins & 0x3F, (rest >> 4) | ((low_mins >> 2) & 0x30)], axis=-1)
    return sc, mn


def _k_quant_codes(qs: np.ndarray) -> np.ndarray:
    """A Q4_K or Q5_K block's 128 code bytes ``[..., 128]`` as its 256 low four bits: each run
    of 32 bytes holds one sub-block in its low nibbles and the next in its high ones."""
    runs = qs.reshape(*qs.shape[:-1], 4, 32)
    return _nibbles(runs).reshape(*qs.shape[:-1], 256)


def repack(kind: T, data: np.ndarray, rows: int, cols: int) -> QuantizedWeight:
    """The quantized tensor of ``kind`` whose bytes are ``data`` (``[rows, bytes per row]``) in
    mmkv's layout (the module docstring's table)."""
    block_weights, block_bytes = GGML_QUANT_SIZES[kind]
    if cols % block_weights:
        raise ValueError(f"a {kind.name} row of {cols} weights is not a whole number of blocks")
    step = max(1, CHUNK_ELEMENTS // cols)
    whole: dict | None = None
    for start in range(0, rows, step):
        end = min(start + step, rows)
        part = _repack_rows(kind, np.asarray(data[start:end]).reshape(end - start, -1, block_bytes))
        values = {name: getattr(part, name) for name in part.__slots__}
        tensors = {name: v for name, v in values.items() if isinstance(v, torch.Tensor)}
        if whole is None:  # every field's tensor for all the rows, made once (one for fields sharing one)
            made = {id(v): torch.empty((rows, *v.shape[1:]), dtype=v.dtype) for v in tensors.values()}
            whole = {name: made[id(v)] if name in tensors else v for name, v in values.items()}
        for value, target in {id(v): (v, whole[name]) for name, v in tensors.items()}.values():
            target[start:end] = value
    return type(part)(**whole)


def _repack_rows(kind: T, b: np.ndarray) -> QuantizedWeight:
    """``repack`` of whole rows whose blocks are ``b`` ``[rows, blocks, bytes]``."""
    rows, cols = b.shape[0], b.shape[1] * GGML_QUANT_SIZES[kind][0]
    if kind == T.Q8_0:
        return Int8GroupWeight(_int8(b[..., 2:].view(np.int8).reshape(rows, cols)), _half(b, 0), 32)
    if kind in (T.Q4_0, T.Q4_1):
        d = _half(b, 0)
        start = 2 if kind == T.Q4_0 else 4
        codes = _packed_int4(_nibbles(b[..., start:start + 16]).reshape(rows, cols))
        if kind == T.Q4_0:
            return Int4Weight(codes, d, d, 32, offset_codes=torch.full_like(d, -8, dtype=torch.int8))
        return Int4Weight(codes, d, _half(b, 2), 32)
    if kind in (T.Q5_0, T.Q5_1):
        start = 2 if kind == T.Q5_0 else 4
        q = _nibbles(b[..., start + 4:start + 20]) | (_fifth_bits(b[..., start:start + 4], 32) << 4)
        if kind == T.Q5_0:
            return Int8GroupWeight(_int8(q.reshape(rows, cols).astype(np.int16) - 16), _half(b, 0), 32)
        return Int8GroupWeight(_int8(q.reshape(rows, cols)), _half(b, 0), 32, _half(b, 2))
    if kind in (T.Q4_K, T.Q5_K):
        d, negative_dmin = _half(b, 0), -_half(b, 2)
        sc, mn = _k_scales(b[..., 4:16])
        sc, mn = _int8(sc.reshape(rows, -1)), _int8(mn.reshape(rows, -1))
        if kind == T.Q4_K:
            codes = _packed_int4(_k_quant_codes(b[..., 16:144]).reshape(rows, cols))
            return Int4Weight(codes, d, negative_dmin, 32, sc, mn)
        high = (b[..., 16:48, None] >> np.arange(8, dtype=np.uint8)) & 1  # [rows, n, 32 weights, 8 sub-blocks]
        high = high.transpose(0, 1, 3, 2).reshape(rows, -1, 256)
        q = _k_quant_codes(b[..., 48:176]) | (high << 4)
        return Int8GroupWeight(_int8(q.reshape(rows, cols)), d, 32, negative_dmin, sc, mn)
    if kind == T.Q6_K:
        ql, qh = b[..., 0:128], b[..., 128:192]
        # ql: two halves of 64 bytes, each 64 weights in low nibbles then 64 in high ones;
        # qh: two halves of 32 bytes, each byte's bit pairs 0-1, 2-3, 4-5, 6-7 the top bits of
        # the half's weights 0-31, 32-63, 64-95, 96-127
        low = _nibbles(ql.reshape(rows, -1, 2, 64)).reshape(rows, -1, 256)
        top = (qh.reshape(rows, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3
        q = (low | (top.reshape(rows, -1, 256) << 4)).astype(np.int16) - 32
        return Int8GroupWeight(_int8(q.reshape(rows, cols)), _half(b, 208), 16, None,
                               _int8(b[..., 192:208].view(np.int8).reshape(rows, -1)))
    raise ValueError(f"GGUF type {kind.name} is not one mmkv repacks")


def read_float(kind: T, data: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of any supported type as ``dtype`` (the quantized ones dequantized, for tensors
    mmkv keeps unquantized: embeddings, norms), a copy of the file's bytes."""
    if kind == T.BF16:
        bits = torch.from_numpy(np.ascontiguousarray(data).view(np.int16))
        return bits.view(torch.bfloat16).to(dtype)
    if kind in (T.F32, T.F16):
        return torch.from_numpy(np.array(data)).to(dtype)
    return torch.from_numpy(quants.dequantize(np.asarray(data), kind)).to(dtype)
