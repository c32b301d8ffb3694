"""A native kernel for batched decode attention on the CPU that reads the paged KV cache in place.

The torch path copies every page a decode step reads into a contiguous tensor (``index_select``)
before SDPA's kernel reads it again, pads each sequence to the longest one's pages and masks the
padding, then merges a cascade's shared part with each sequence's own by log-sum-exp in a dozen
small tensor operations. ``paged_decode.c`` does the per-sequence part in one pass: for each
sequence and KV head it walks the sequence's pages where they lie, with an online softmax that
starts from the shared part's state, so nothing is copied, padded or merged afterwards.

It is built with mmkv's other native kernels (``mmkv.native``); without a compiler, or with
``MMKV_NATIVE=0``, ``kernel()`` is ``None`` and the torch path runs.

Guarantees: ``paged_decode`` equals the torch path's attention (dense causal attention over the
sequence's keys, within the sliding window, merged with the given state) up to float32 rounding,
for float32, bfloat16, int8 and fp8 caches (a compressed page decoded as the kernel reads it); ``tests/test_native_attention.py`` checks it against dense float64
attention, and ``tests/test_torch_attention.py`` runs every paged-attention test on both paths.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from cache import kv_format
from mmkv import native as native_library

# cache dtypes the kernel reads (cache.kv_format), by the code it knows them by
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2, torch.float8_e4m3fn: 3}

_ARGTYPES = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64,
             ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
             ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_int64,
             ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]


@functools.cache
def kernel() -> ctypes._CFuncPtr | None:
    """The compiled ``mmkv_paged_decode``, or ``None`` (disabled, or it could not be built)."""
    return native_library.function("mmkv_paged_decode", _ARGTYPES)


def supports(query: torch.Tensor, layer: torch.Tensor) -> bool:
    """Whether the kernel can attend these float32 queries over this cache layer."""
    return (query.device.type == "cpu" and query.dtype == torch.float32
            and layer.dtype in DTYPES and layer.is_contiguous() and kernel() is not None)


def paged_decode(q: torch.Tensor, layer: torch.Tensor, pages: torch.Tensor, lens: torch.Tensor,
                 key_start: torch.Tensor, positions: torch.Tensor, scale: float,
                 window: int | None, state: tuple[torch.Tensor, torch.Tensor] | None,
                 check_bounds: bool = False) -> torch.Tensor:
    """Attention output ``[d, m, q_heads, head_dim]`` of ``d`` sequences' queries ``q`` (same
    shape, at ``positions [d, m]``) over the ``lens[i]`` keys in pages ``pages[i]``, the first at
    position ``key_start[i]``; ``state`` is ``(out [d, kv_heads, m * G, D], lse [d, kv_heads,
    m * G, 1])`` of keys the rows attended before (lse ``-inf`` where none), merged in. With
    ``check_bounds`` every input the kernel indexes is checked first (``_check``): a bad one raises
    ``IndexError``/``ValueError`` and the kernel is not called."""
    d, m, hq, dim = q.shape
    _, _, block_size, hkv, _ = layer.shape
    if kv_format.head_dim_of(layer) != dim:
        raise ValueError(f"queries of head size {dim} cannot attend a cache layer of head size "
                         f"{kv_format.head_dim_of(layer)}")
    q = q.contiguous()
    out = torch.empty_like(q)
    pages, lens, key_start, positions = (t.contiguous() for t in (pages, lens, key_start, positions))
    init_out, init_lse = (None, None) if state is None else (s.contiguous() for s in state)
    if check_bounds:
        _check(q, layer, pages, lens, key_start, positions, init_out, init_lse)
    status = kernel()(q.data_ptr(), layer.data_ptr(), DTYPES[layer.dtype], pages.data_ptr(),
                      pages.shape[1], lens.data_ptr(), key_start.data_ptr(), positions.data_ptr(),
                      d, m, block_size, hq, hkv, dim, scale, window or 0,
                      None if init_out is None else init_out.data_ptr(),
                      None if init_lse is None else init_lse.data_ptr(), out.data_ptr())
    if status:
        raise MemoryError("native decode attention could not allocate its scratch memory")
    return out


def _check(q: torch.Tensor, layer: torch.Tensor, pages: torch.Tensor, lens: torch.Tensor,
           key_start: torch.Tensor, positions: torch.Tensor, init_out: torch.Tensor | None,
           init_lse: torch.Tensor | None) -> None:
    """What ``paged_decode`` hands the kernel, checked: page ids inside the layer and lengths
    inside their pages (``native_library.check_pages``), and every other array of the shape the
    kernel reads (``ValueError`` naming the array and the shape needed)."""
    d, m, hq, dim = q.shape
    hkv, layer_dim = layer.shape[3], kv_format.head_dim_of(layer)
    if layer_dim != dim or hq % hkv:
        raise ValueError(f"queries [{d}, {m}, {hq}, {dim}] do not fit a cache layer of {hkv} KV "
                         f"heads of size {layer_dim}: head sizes must match and {hq} query heads "
                         f"be a multiple of {hkv}")
    native_library.check_index_shape("pages", pages, (d, None))
    native_library.check_pages(layer, pages, lens)
    native_library.check_index_shape("key_start", key_start, (d,))
    native_library.check_index_shape("positions", positions, (d, m))
    rows = m * (hq // hkv)
    for name, state, shape in (("state's out", init_out, (d, hkv, rows, dim)),
                               ("state's lse", init_lse, (d, hkv, rows, 1))):
        if state is not None and (state.dtype != torch.float32 or tuple(state.shape) != shape):
            raise ValueError(f"{name} is {state.dtype} {tuple(state.shape)}; the kernel reads "
                             f"float32 {shape}")
