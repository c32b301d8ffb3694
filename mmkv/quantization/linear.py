"""Linear layers over quantized weights: ``y = x @ w.T + bias`` with ``w`` the weight's
``dequantize()`` (``mmkv.quantization.formats``), never stored in full precision.

Two ways to run one, chosen per call by the number of rows:

- **native** (CPU, up to ``NATIVE_ROWS`` rows): ``mmkv/native/quantized_linear.c`` reads the
  int8 or int4 codes and decodes them in registers, every weight byte read once per call. A
  decode step is bound by the bytes it reads, so this is where quantized weights pay.
- **dense** (more rows, other devices, or no native library): the weight is dequantized into the
  rows' dtype for this call alone and multiplied by ``F.linear`` (on the CPU, oneDNN or MKL), so a
  prefill of many rows runs at the full-precision GEMM's speed plus one decode of the weight. On
  the CPU the decode goes into a buffer each thread keeps for it (``dequantize_buffer``: one
  layer's weight in full precision, the largest met), so no call pays a fresh allocation's page
  faults.

``NATIVE_ROWS`` is where the native kernel stopped being faster on the measured machine (between
16 and 32 rows on TinyLlama's layer shapes: ``python -m mmkv.bench weights --kernels --json``;
docs/quantization.md). Guarantees: either way
the result is ``F.linear(x, w, bias)`` up to float rounding; the layer holds the quantized weight
only (and a float32 copy of a bias).
"""

from __future__ import annotations

import ctypes
import threading

import torch
import torch.nn.functional as F

from mmkv import native
from mmkv.quantization.formats import Int4Weight, Int8Weight, QuantizedWeight

NATIVE_ROWS = 16  # row counts up to this run natively on the CPU; more run dense

_INT8_ARGS = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
              ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
_INT4_ARGS = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
              ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
_INT8_DEQUANTIZE_ARGS = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                         ctypes.c_void_p]
_INT4_DEQUANTIZE_ARGS = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                         ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
NATIVE_GROUP = 32  # an int4 group the native kernel runs must be a multiple of this
DEQUANTIZED_DTYPES = (torch.float32, torch.bfloat16)  # what the native dequantization writes

_BUFFERS = threading.local()  # each thread's buffers for a dequantized weight, by dtype


def dequantize_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """This thread's buffer for ``numel`` values of ``dtype`` (grown to the largest asked; the
    engine's step and the vision encoder's thread each have their own)."""
    buffers = _BUFFERS.__dict__.setdefault("by_dtype", {})
    buffer = buffers.get(dtype)
    if buffer is None or buffer.numel() < numel:
        buffer = buffers[dtype] = torch.empty(numel, dtype=dtype)
    return buffer[:numel]


def native_kernels(weight: QuantizedWeight) -> tuple | None:
    """The native kernels that run ``weight`` (its linear layer on float32 rows, on bfloat16
    rows, its dequantization), or None (not on the CPU, no library, or an int4 group size the
    kernel does not take)."""
    if weight.codes.device.type != "cpu":
        return None
    if isinstance(weight, Int8Weight):
        kernels = (native.function("mmkv_int8_linear", _INT8_ARGS),
                   native.function("mmkv_int8_linear_bf16", _INT8_ARGS),
                   native.function("mmkv_int8_dequantize", _INT8_DEQUANTIZE_ARGS),
                   native.function("mmkv_int8_dequantize_bf16", _INT8_DEQUANTIZE_ARGS))
    elif weight.group_size % NATIVE_GROUP:
        return None
    else:
        kernels = (native.function("mmkv_int4_linear", _INT4_ARGS),
                   native.function("mmkv_int4_linear_bf16", _INT4_ARGS),
                   native.function("mmkv_int4_dequantize", _INT4_DEQUANTIZE_ARGS),
                   native.function("mmkv_int4_dequantize_bf16", _INT4_DEQUANTIZE_ARGS))
    return None if kernels[0] is None else kernels


class QuantizedLinear:
    """``y = x @ weight.dequantize().T + bias`` for rows ``x`` ``[n, in]`` (the module docstring)."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None) -> None:
        self.weight = weight
        self.bias = None if bias is None else bias.detach()
        self.bias32 = None if bias is None else bias.detach().float().contiguous()
        self.kernels = native_kernels(weight)
        self.bfloat16_kernel = self.kernels is not None  # until the kernel says it cannot
        self.out_features, self.in_features = weight.shape

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + (0 if self.bias is None else self.bias.nbytes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and x.shape[0] <= NATIVE_ROWS:
            return self.native(x)
        return self.dense(x)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight in ``dtype``: natively into this thread's buffer where the kernels are
        built (float32 or bfloat16; valid until this thread's next call), else a new tensor."""
        if self.kernels is None or dtype not in DEQUANTIZED_DTYPES:
            return self.weight.dequantize(dtype)
        w, kernel = self.weight, self.kernels[2 if dtype == torch.float32 else 3]
        out = dequantize_buffer(self.out_features * self.in_features, dtype)
        out = out.view(self.out_features, self.in_features)
        if isinstance(w, Int8Weight):
            kernel(w.codes.data_ptr(), w.scale.data_ptr(), self.out_features, self.in_features,
                   out.data_ptr())
        else:
            kernel(w.codes.data_ptr(), w.scale.data_ptr(), w.offset.data_ptr(), w.group_size,
                   self.out_features, self.in_features, out.data_ptr())
        return out

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        """The rows through the weight dequantized for this call, in the rows' dtype."""
        return F.linear(x, self.dequantized(x.dtype), self.bias)

    def native(self, x: torch.Tensor) -> torch.Tensor:
        """The rows through the native kernel: bfloat16 rows by bfloat16 weights where the CPU
        has the instruction (``quantized_linear.c``), else float32 arithmetic."""
        if x.dtype == torch.bfloat16 and self.bfloat16_kernel:
            y = self.run_kernel(self.kernels[1], x.contiguous())
            if y is not None:
                return y.to(x.dtype)
            self.bfloat16_kernel = False
        y = self.run_kernel(self.kernels[0], x.float().contiguous())
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def run_kernel(self, kernel, rows: torch.Tensor) -> torch.Tensor | None:
        """float32 ``rows @ w.T + bias`` by ``kernel``, or None where it declines the shape."""
        y = torch.empty(rows.shape[0], self.out_features, dtype=torch.float32)
        bias = 0 if self.bias32 is None else self.bias32.data_ptr()
        w = self.weight
        if isinstance(w, Int8Weight):
            status = kernel(rows.data_ptr(), rows.shape[0], self.in_features, w.codes.data_ptr(),
                            w.scale.data_ptr(), bias, y.data_ptr(), self.out_features)
        else:
            status = kernel(rows.data_ptr(), rows.shape[0], self.in_features, w.codes.data_ptr(),
                            w.scale.data_ptr(), w.offset.data_ptr(), w.group_size, bias, y.data_ptr(),
                            self.out_features)
        return y if status == 0 else None


class QuantizedLinearModule(torch.nn.Module):
    """An ``nn.Linear`` whose weight is quantized, with ``nn.Linear``'s ``forward`` contract over
    any leading dimensions: ``weight`` holds the codes, the buffers ``scale`` (and ``offset``)
    the rest of the layout, so ``.to(device)`` moves all of it. (``weight`` keeps nn.Linear's name
    so a checkpoint's key finds it while loading; its float value never stays.)"""

    def __init__(self, in_features: int, out_features: int, bias: bool, method: str,
                 group_size: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.method, self.group_size = method, group_size
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.register_buffer("scale", torch.empty(0))
        self.register_buffer("offset", torch.empty(0) if method == "int4" else None)
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
        int4 = isinstance(weight, Int4Weight)
        module = cls(in_features, out_features, bias is not None, "int4" if int4 else "int8",
                     weight.group_size if int4 else 0)
        for name, tensor in cls.state_of("", weight).items():
            module.set_tensor(name.lstrip("."), tensor)
        if bias is not None:
            module.bias = torch.nn.Parameter(bias.detach(), requires_grad=False)
        return module

    @staticmethod
    def state_of(prefix: str, weight: QuantizedWeight) -> dict[str, torch.Tensor]:
        """The module's tensors for ``weight``, under ``prefix``."""
        state = {f"{prefix}.weight": weight.codes, f"{prefix}.scale": weight.scale}
        if isinstance(weight, Int4Weight):
            state[f"{prefix}.offset"] = weight.offset
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
        return Int4Weight(self.weight.data, self.scale, self.offset, self.group_size)

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
        group = f", group_size={self.group_size}" if self.method == "int4" else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"method={self.method}{group}, bias={self.bias is not None}")


__all__ = ["Int4Weight", "Int8Weight", "NATIVE_ROWS", "QuantizedLinear", "QuantizedLinearModule",
           "native_kernels"]
