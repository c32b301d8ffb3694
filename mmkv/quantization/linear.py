"""Linear layers over quantized weights: ``y = x @ w.T + bias`` with ``w`` the weight's
``dequantize()`` (``mmkv.quantization.formats``), never stored in full precision.

Two ways to run one, chosen per call by the number of rows:

- **native** (CPU, up to ``NATIVE_ROWS`` rows, or ``TILE_ROWS`` bfloat16 rows where they run as
  AMX tiles): ``mmkv/native/quantized_linear.c`` reads the int8 or int4 codes and decodes them in
  registers, every weight byte read once per call (per 32 rows on tiles). A decode step is bound
  by the bytes it reads, so this is where quantized weights pay.
- **dense** (more rows, other devices, or no native library): the weight is dequantized into the
  rows' dtype for this call alone and multiplied by ``F.linear`` (on the CPU, oneDNN or MKL), so a
  prefill of many rows runs at the full-precision GEMM's speed plus one decode of the weight. On
  the CPU the decode goes into a buffer each thread keeps for it (``dequantize_buffer``: one
  layer's weight in full precision, the largest met), so no call pays a fresh allocation's page
  faults; an engine drops its step thread's buffers when it goes idle
  (``release_dequantize_buffers``).

bfloat16 rows on the CPU run either of two ways, whichever is faster on this CPU
(``bfloat16_way``, timed once per process, path and row count on a synthetic layer):

- **bfloat16**: the weight in bfloat16 (each value rounded to it) meets the rows in the CPU's
  bfloat16 dot-product instruction or, from 8 rows where the CPU has AMX, its tile product
  (native), or oneDNN's bfloat16 GEMM (dense); products summed in float32.
- **float32**: the rows widened to float32 (exactly) meet the weight in float32 (not rounded) by
  float32 FMAs (native) or the float32 GEMM (dense); the result rounded to bfloat16. Where the
  dot-product instruction runs at half the FMAs' rate (Intel Xeon without AMX) this is the
  faster; where it runs at the same rate or better (AMD EPYC), the bfloat16 way is.

``NATIVE_ROWS`` is where the native kernel stops being faster than the dense way on the measured
machines (between 32 and 64 rows on TinyLlama's layer shapes, on an AMD EPYC and an Intel Xeon:
``python -m mmkv.bench weights --kernels --json``; docs/quantization.md). Guarantees: every way's
result is ``F.linear(x, w, bias)`` up to float rounding (the float32 way's weights are the more
exact); the layer holds the quantized weight only (and a float32 copy of a bias).
"""

from __future__ import annotations

import ctypes
import math
import threading
import time

import torch
import torch.nn.functional as F

from mmkv import native
from mmkv.quantization.formats import (Int4Weight, Int8GroupWeight, Int8Weight, Quantization,
                                       QuantizedWeight, quantize, select_rows)

NATIVE_ROWS = 32  # row counts up to this run natively on the CPU; more run dense
TILE_ROWS = 64  # ... but bfloat16 rows up to this, where the native bfloat16 way runs as AMX tiles
FLOAT32_DENSE_ROWS = 128  # from this many rows the dense way may run float32 (bfloat16_way)

_P = ctypes.c_void_p
_INT8_ARGS = [_P, ctypes.c_int64, ctypes.c_int64, _P, _P, _P, _P, ctypes.c_int64]
_GROUPED_ARGS = [_P, ctypes.c_int64, ctypes.c_int64, _P, _P, _P, ctypes.c_int64, _P, _P, ctypes.c_int64]
_INT8_DEQUANTIZE_ARGS = [_P, _P, ctypes.c_int64, ctypes.c_int64, _P]
_GROUPED_DEQUANTIZE_ARGS = [_P, _P, _P, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, _P]
NATIVE_GROUP = 32  # an int4 group the native kernel runs must be a multiple of this
NATIVE_INT8_GROUP = 16  # ... and an int8 group
DEQUANTIZED_DTYPES = (torch.float32, torch.bfloat16)  # what the native dequantization writes
KERNELS = {  # each layout's kernels: float32 rows, bfloat16 rows, dequantized to float32, to bfloat16
    "int8": (("mmkv_int8_linear", _INT8_ARGS), ("mmkv_int8_linear_bf16", _INT8_ARGS),
             ("mmkv_int8_dequantize", _INT8_DEQUANTIZE_ARGS),
             ("mmkv_int8_dequantize_bf16", _INT8_DEQUANTIZE_ARGS)),
    "int4": (("mmkv_int4_linear", _GROUPED_ARGS), ("mmkv_int4_linear_bf16", _GROUPED_ARGS),
             ("mmkv_int4_dequantize", _GROUPED_DEQUANTIZE_ARGS),
             ("mmkv_int4_dequantize_bf16", _GROUPED_DEQUANTIZE_ARGS)),
    "int8_group": (("mmkv_int8_group_linear", _GROUPED_ARGS), ("mmkv_int8_group_linear_bf16", _GROUPED_ARGS),
                   ("mmkv_int8_group_dequantize", _GROUPED_DEQUANTIZE_ARGS),
                   ("mmkv_int8_group_dequantize_bf16", _GROUPED_DEQUANTIZE_ARGS)),
}

_BUFFERS = threading.local()  # each thread's buffers for a dequantized weight, by dtype


def dequantize_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """This thread's buffer for ``numel`` values of ``dtype`` (grown to the largest asked; the
    engine's step and the vision encoder's thread each have their own)."""
    buffers = _BUFFERS.__dict__.setdefault("by_dtype", {})
    buffer = buffers.get(dtype)
    if buffer is None or buffer.numel() < numel:
        buffer = buffers[dtype] = torch.empty(numel, dtype=dtype)
    return buffer[:numel]


def release_dequantize_buffers() -> None:
    """Drop this thread's buffers (an idle engine holds none: the next call that needs one makes
    it again)."""
    _BUFFERS.__dict__.pop("by_dtype", None)


class GroupValues(ctypes.Structure):
    """``quantized_linear.c``'s ``group_values``: a grouped weight's scales or offsets as
    ``formats.group_values`` reads them (no values: every one is 0)."""

    _fields_ = [("values", _P), ("codes", _P), ("count", ctypes.c_int64), ("float32", ctypes.c_int64)]

    @classmethod
    def of(cls, values: torch.Tensor | None, codes: torch.Tensor | None) -> GroupValues:
        if values is None:
            return cls(None, None, 1, 1)
        return cls(values.data_ptr(), None if codes is None else codes.data_ptr(), values.shape[1],
                   int(values.dtype == torch.float32))


def native_kernels(weight: QuantizedWeight) -> tuple | None:
    """The native kernels that run ``weight`` (its linear layer on float32 rows, on bfloat16
    rows, its dequantization to float32 and to bfloat16), or None (not on the CPU, no
    library, or a group size or group values the kernels do not take)."""
    if weight.codes.device.type != "cpu":
        return None
    if isinstance(weight, (Int4Weight, Int8GroupWeight)):
        multiple = NATIVE_GROUP if isinstance(weight, Int4Weight) else NATIVE_INT8_GROUP
        values = [v for v in (weight.scale, weight.offset) if v is not None]
        if weight.group_size % multiple or any(
                v.dtype not in (torch.float16, torch.float32) or not v.is_contiguous() for v in values):
            return None
    kernels = tuple(native.function(*spec) for spec in KERNELS[weight.method])
    return None if kernels[0] is None else kernels


def amx_rows() -> int:
    """The fewest rows the native bfloat16 kernels run as AMX tiles on this CPU (0: never; no
    AMX, the kernel refused the tile state, or no native library)."""
    count = native.function("mmkv_amx_rows", [])
    return 0 if count is None else count()


BFLOAT16_WAYS = ("bfloat16", "float32")  # how bfloat16 rows can run (the module docstring)
# the row counts each path's ways are timed at: a call follows the timing nearest its rows (by
# ratio; the larger on a tie). Natively three: on AMX the bfloat16 way's tiles cost about the same
# from 8 rows to 32 while the float32 way grows with the rows, and below 8 rows the bfloat16 way
# is the dot-product kernel, so the faster way at one count need not be the faster at another.
TIMED_ROWS = {"native": (1, 4, 16), "dense": (2 * FLOAT32_DENSE_ROWS,)}
_FASTER_WAY: dict[tuple[str, int], str] = {}  # (path, timed rows) -> the faster way there, once timed


def bfloat16_way(path: str, rows: int) -> str:
    """The way ``rows`` bfloat16 rows run on ``path`` ("native" or "dense") on this CPU: the
    faster of ``BFLOAT16_WAYS`` on a synthetic layer at the ``TIMED_ROWS`` count nearest
    ``rows``, timed at the first need (``time_bfloat16_ways``). Dense calls of fewer than
    ``FLOAT32_DENSE_ROWS`` rows stay bfloat16: dequantizing to float32 writes twice the bytes,
    which a short GEMM does not win back."""
    if path == "dense" and rows < FLOAT32_DENSE_ROWS:
        return "bfloat16"
    timed = min(reversed(TIMED_ROWS[path]), key=lambda t: abs(math.log(max(rows, 1) / t)))
    if (path, timed) not in _FASTER_WAY:
        _FASTER_WAY[path, timed] = time_bfloat16_ways(path, timed)
    return _FASTER_WAY[path, timed]


@torch.inference_mode()
def time_bfloat16_ways(path: str, rows: int, calls: int = 5) -> str:
    """Which of ``BFLOAT16_WAYS`` runs ``path`` faster here on ``rows`` rows: an int4 layer of
    1024 x 2048, each way's fastest of ``calls`` calls, the ways taking turns. Once per path and
    row count: about 35 ms natively, 0.12-0.14 s densely (a 2-core Xeon)."""
    generator = torch.Generator().manual_seed(0)
    weight = quantize(torch.randn(1024, 2048, generator=generator) * 0.02, Quantization("int4"))
    layer = QuantizedLinear(weight, None)
    x = torch.randn(rows, 2048, generator=generator).bfloat16()
    if path == "native" and (layer.kernels is None or layer.run_kernel(layer.kernels[1], x) is None):
        return "float32"  # no bfloat16 kernel here (no library, or no AVX512-BF16): nothing to time
    run = getattr(layer, path)
    best = dict.fromkeys(BFLOAT16_WAYS, float("inf"))
    for _ in range(calls + 1):  # the first call of each way warms it, and is counted like the rest
        for way in BFLOAT16_WAYS:
            start = time.perf_counter()
            run(x, way)
            best[way] = min(best[way], time.perf_counter() - start)
    return min(BFLOAT16_WAYS, key=best.__getitem__)


class QuantizedLinear:
    """``y = x @ weight.dequantize().T + bias`` for rows ``x`` ``[n, in]`` (the module docstring)."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None) -> None:
        self.weight = weight
        self.bias = None if bias is None else bias.detach()
        self.bias32 = None if bias is None else bias.detach().float().contiguous()
        self.kernels = native_kernels(weight)
        self.bfloat16_kernel = self.kernels is not None  # until the kernel says it cannot
        self.tiles = amx_rows() if self.kernels is not None else 0  # bfloat16 rows from this run as tiles
        self.out_features, self.in_features = weight.shape
        if isinstance(weight, Int8Weight):
            self.layout = (weight.scale.data_ptr(),)
        else:  # the group values the kernels read, and the group size
            self.group_values = (GroupValues.of(weight.scale, weight.scale_codes),
                                 GroupValues.of(weight.offset, weight.offset_codes))
            self.layout = (*map(ctypes.addressof, self.group_values), weight.group_size)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + (0 if self.bias is None else self.bias.nbytes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and (x.shape[0] <= NATIVE_ROWS or self.runs_as_tiles(x)):
            return self.native(x)
        return self.dense(x)

    def runs_as_tiles(self, x: torch.Tensor) -> bool:
        """Whether rows past ``NATIVE_ROWS`` run natively: bfloat16 rows, up to ``TILE_ROWS``,
        where the native bfloat16 way runs as AMX tiles here and is the faster way. The tiles
        decode the weight once per 32 rows, which beats dequantizing it for the GEMM up to about
        64 rows (docs/quantization.md); the float32 kernels do not."""
        return (NATIVE_ROWS < x.shape[0] <= TILE_ROWS and x.dtype == torch.bfloat16
                and self.tiles > 0 and self.bfloat16_kernel
                and bfloat16_way("native", x.shape[0]) == "bfloat16")

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight in ``dtype``: natively into this thread's buffer where the kernels are
        built (float32 or bfloat16; valid until this thread's next call), else a new tensor."""
        if self.kernels is None or dtype not in DEQUANTIZED_DTYPES:
            return self.weight.dequantize(dtype)
        kernel = self.kernels[2 if dtype == torch.float32 else 3]
        out = dequantize_buffer(self.out_features * self.in_features, dtype)
        out = out.view(self.out_features, self.in_features)
        kernel(self.weight.codes.data_ptr(), *self.layout, self.out_features, self.in_features,
               out.data_ptr())
        return out

    def dense(self, x: torch.Tensor, way: str | None = None) -> torch.Tensor:
        """The rows through the weight dequantized for this call: in the rows' dtype, or for
        bfloat16 rows on the CPU in float32 where that ``way`` is the faster for as many rows
        (``bfloat16_way``; ``way`` names one)."""
        if (x.dtype == torch.bfloat16 and x.device.type == "cpu"
                and (way or bfloat16_way("dense", x.shape[0])) == "float32"):
            return F.linear(x.float(), self.dequantized(torch.float32), self.bias32).to(x.dtype)
        return F.linear(x, self.dequantized(x.dtype), self.bias)

    def native(self, x: torch.Tensor, way: str | None = None) -> torch.Tensor:
        """The rows through the native kernel: bfloat16 rows by bfloat16 weights where the CPU
        has the instruction (``quantized_linear.c``) and it is the faster way here
        (``bfloat16_way``; ``way`` names one), else float32 arithmetic."""
        if (x.dtype == torch.bfloat16 and self.bfloat16_kernel
                and (way or bfloat16_way("native", x.shape[0])) == "bfloat16"):
            y = self.run_kernel(self.kernels[1], x.contiguous())
            if y is not None:
                return y.to(x.dtype)
            self.bfloat16_kernel = False
        y = self.run_kernel(self.kernels[0], x.float().contiguous())
        if y is None:  # the kernel declines the shape: the dense way from now on
            self.kernels = None
            return self.dense(x)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def run_kernel(self, kernel, rows: torch.Tensor) -> torch.Tensor | None:
        """float32 ``rows @ w.T + bias`` by ``kernel``, or None where it declines the shape."""
        y = torch.empty(rows.shape[0], self.out_features, dtype=torch.float32)
        bias = 0 if self.bias32 is None else self.bias32.data_ptr()
        status = kernel(rows.data_ptr(), rows.shape[0], self.in_features, self.weight.codes.data_ptr(),
                        *self.layout, bias, y.data_ptr(), self.out_features)
        return y if status == 0 else None


class QuantizedLinearModule(torch.nn.Module):
    """An ``nn.Linear`` whose weight is quantized, with ``nn.Linear``'s ``forward`` contract over
    any leading dimensions: ``weight`` holds the codes, the buffers ``scale`` (and ``offset``,
    ``scale_codes``, ``offset_codes`` where the layout has them) the rest of the layout, so
    ``.to(device)`` moves all of it. (``weight`` keeps nn.Linear's name so a checkpoint's key
    finds it while loading; its float value never stays.)"""

    def __init__(self, in_features: int, out_features: int, bias: bool, method: str,
                 group_size: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.method, self.group_size = method, group_size
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.register_buffer("scale", torch.empty(0))
        self.register_buffer("offset", torch.empty(0) if method == "int4" else None)
        self.register_buffer("scale_codes", None)
        self.register_buffer("offset_codes", None)
        self.bias = torch.nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self._linear: QuantizedLinear | None = None

    @classmethod
    def empty(cls, in_features: int, out_features: int, bias: bool,
              quantization) -> QuantizedLinearModule:
        """A layer for a loader to fill (``state_of`` names what it sets)."""
        method = quantization.method_for(in_features)
        return cls(in_features, out_features, bias, method, quantization.group_size)

    @classmethod
    def of(cls, weight: QuantizedWeight, bias: torch.Tensor | None) -> QuantizedLinearModule:
        """A layer over a quantized weight (and a float bias)."""
        out_features, in_features = weight.shape
        module = cls(in_features, out_features, bias is not None, weight.method,
                     getattr(weight, "group_size", 0))
        for name, tensor in cls.state_of("", weight).items():
            module.set_tensor(name.lstrip("."), tensor)
        if bias is not None:
            module.bias = torch.nn.Parameter(bias.detach(), requires_grad=False)
        return module

    @staticmethod
    def state_of(prefix: str, weight: QuantizedWeight) -> dict[str, torch.Tensor]:
        """The module's tensors for ``weight``, under ``prefix``."""
        state = {f"{prefix}.weight": weight.codes}
        for name in ("scale", "offset", "scale_codes", "offset_codes"):
            if getattr(weight, name, None) is not None:
                state[f"{prefix}.{name}"] = getattr(weight, name)
        return state

    def set_tensor(self, name: str, tensor: torch.Tensor) -> None:
        if name == "weight":
            self.weight = torch.nn.Parameter(tensor, requires_grad=False)
        else:
            setattr(self, name, tensor)
        self._linear = None

    @property
    def quantized(self) -> QuantizedWeight:
        if self.method == "int8":
            return Int8Weight(self.weight.data, self.scale)
        codes = {"scale_codes": self.scale_codes, "offset_codes": self.offset_codes}
        if self.method == "int4":
            return Int4Weight(self.weight.data, self.scale, self.offset, self.group_size, **codes)
        return Int8GroupWeight(self.weight.data, self.scale, self.group_size, self.offset, **codes)

    @property
    def linear(self) -> QuantizedLinear:
        """The layer as mmkv runs it (remade when the tensors move)."""
        if self._linear is None:
            self._linear = QuantizedLinear(self.quantized, self.bias)
        return self._linear

    def _apply(self, fn, recurse: bool = True):
        dtypes = {name: t.dtype for name, t in self._buffers.items() if t is not None}
        super()._apply(fn, recurse)
        for name, dtype in dtypes.items():  # a model's .to(dtype) leaves the layout's dtypes alone
            setattr(self, name, self._buffers[name].to(dtype))
        self._linear = None
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        return self.linear(flat).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.method != "int8" else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"method={self.method}{group}, bias={self.bias is not None}")


class QuantizedEmbedding(torch.nn.Module):
    """An embedding table held quantized (a GGUF file's token embeddings): a lookup dequantizes
    only the rows it reads, into ``dtype``. Its tensors live in ``layer``, a
    ``QuantizedLinearModule`` over the same weight, which a tied LM head runs as it is."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer = QuantizedLinearModule.of(weight, None)
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = weight.shape

    @property
    def weight(self) -> torch.nn.Parameter:
        """The codes (what a tied head shares)."""
        return self.layer.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = select_rows(self.layer.quantized, ids.reshape(-1))
        return rows.dequantize(self.dtype).view(*ids.shape, self.embedding_dim)


__all__ = ["BFLOAT16_WAYS", "FLOAT32_DENSE_ROWS", "Int4Weight", "Int8GroupWeight", "Int8Weight",
           "NATIVE_ROWS", "QuantizedEmbedding", "QuantizedLinear", "QuantizedLinearModule",
           "TILE_ROWS", "amx_rows", "bfloat16_way", "native_kernels"]
