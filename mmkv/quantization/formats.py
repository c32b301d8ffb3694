"""How mmkv stores a quantized linear weight, and the one rule that turns it back into floats.

Three layouts, all weight-only (activations stay in the model's dtype):

- ``Int8Weight``: symmetric, one scale per output channel. ``codes`` int8 ``[out, in]``,
  ``scale`` float32 ``[out]``; ``w[o, i] = codes[o, i] * scale[o]``. A channel's scale is its
  largest magnitude over 127, so every code lies in [-127, 127].
- ``Int4Weight``: asymmetric, one scale and one offset per group of ``group_size`` consecutive
  inputs of an output channel. ``codes`` uint8 ``[out, in / 2]`` holding two codes per byte (input
  ``2j`` in the low nibble, ``2j + 1`` in the high one), ``scale`` and ``offset`` float16
  ``[out, in / group_size]``; ``w[o, i] = codes[o, i] * scale[o, g] + offset[o, g]`` with
  ``g = i // group_size``, computed in float32. A group's offset is its smallest value and its
  scale its range over 15, both rounded to float16 before the codes are chosen, so each code is
  the nearest one under the stored scale and offset. At a group of 32 a weight takes 5 bits.
- ``Int8GroupWeight``: int8 codes ``[out, in]`` with a scale and (optionally) an offset per group
  of ``group_size`` inputs: ``w[o, i] = codes[o, i] * scale[o, g] + offset[o, g]``. mmkv does not
  quantize to it; it holds the 5-, 6- and 8-bit groups of checkpoints quantized elsewhere (GGUF's
  Q8_0, Q5_K and Q6_K: ``mmkv.quantization.gguf``).

Group values in two levels. A checkpoint quantized elsewhere may store a group's scale (or offset)
as a small integer times a value shared by several groups (a GGUF K-quant super-block's ``d`` times
a 6-bit sub-scale). Such a weight keeps both as they are: ``scale`` holds the shared values
``[out, groups / k]`` and ``scale_codes`` the int8 factors ``[out, groups]``, and group ``g``'s scale
is ``scale[o, g // k] * scale_codes[o, g]`` (``group_values``); ``offset`` / ``offset_codes`` alike.
Group values are float16 (as the checkpoint stores them) or float32. Every product is computed in
float32, where a float16 value times a code of up to 8 bits is exact.

Invariant: ``dequantize()`` is the weight the model computes with: every kernel that runs a
quantized layer (``mmkv.quantization.linear``) gives ``x @ dequantize().T`` up to float rounding,
and transformers on a model whose linear weights are replaced by ``dequantize()`` is the oracle
for mmkv's output on the quantized model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT4_MAX = 15
INT8_MAX = 127


@dataclass(slots=True)
class Int8Weight:
    """Symmetric int8 codes with one float32 scale per output channel (the module docstring)."""

    codes: torch.Tensor  # int8 [out, in]
    scale: torch.Tensor  # float32 [out]

    method = "int8"

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.codes.float() * self.scale[:, None]).to(dtype)

    def rows(self, start: int, end: int) -> Int8Weight:
        """Output channels ``[start, end)`` (views of this weight's tensors)."""
        return select_rows(self, slice(start, end))


@dataclass(slots=True)
class Int4Weight:
    """Asymmetric int4 codes, two per byte, with a float16 scale and offset per group of inputs
    (the module docstring)."""

    codes: torch.Tensor  # uint8 [out, in / 2]
    scale: torch.Tensor  # float16 (or float32) [out, in / group_size] (or [out, groups / k])
    offset: torch.Tensor  # float16 (or float32) [out, in / group_size] (or [out, groups / k])
    group_size: int
    scale_codes: torch.Tensor | None = None  # int8 [out, groups] for scales in two levels
    offset_codes: torch.Tensor | None = None  # int8 [out, groups] for offsets in two levels

    method = "int4"

    @property
    def shape(self) -> tuple[int, int]:
        return (self.codes.shape[0], 2 * self.codes.shape[1])

    @property
    def nbytes(self) -> int:
        return _nbytes(self.codes, self.scale, self.offset, self.scale_codes, self.offset_codes)

    def unpacked_codes(self) -> torch.Tensor:
        """The codes as uint8 ``[out, in]``, one per byte."""
        low, high = self.codes & 0x0F, self.codes >> 4
        return torch.stack((low, high), -1).reshape(self.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        out, features = self.shape
        groups = features // self.group_size
        codes = self.unpacked_codes().float().view(out, groups, self.group_size)
        w = (codes * group_values(self.scale, self.scale_codes, groups)[..., None]
             + group_values(self.offset, self.offset_codes, groups)[..., None])
        return w.view(out, features).to(dtype)

    def rows(self, start: int, end: int) -> Int4Weight:
        """Output channels ``[start, end)`` (views of this weight's tensors)."""
        return select_rows(self, slice(start, end))


def group_values(values: torch.Tensor, codes: torch.Tensor | None, groups: int) -> torch.Tensor:
    """Each group's value as float32 ``[out, groups]``: ``values[o, g // k] * codes[o, g]`` with
    ``k = groups / values.shape[1]`` (without ``codes``, ``values[o, g // k]``)."""
    per = groups // values.shape[1]
    expanded = values.float().repeat_interleave(per, 1) if per > 1 else values.float()
    return expanded if codes is None else expanded * codes.float()


def _nbytes(*tensors: torch.Tensor | None) -> int:
    """Bytes of the tensors, one shared by two fields (a scale that is also an offset's) once."""
    return sum({(t.data_ptr(), t.nbytes): t.nbytes for t in tensors if t is not None}.values())


@dataclass(slots=True)
class Int8GroupWeight:
    """int8 codes with a scale and an optional offset per group of inputs, each in one or two
    levels (the module docstring)."""

    codes: torch.Tensor  # int8 [out, in]
    scale: torch.Tensor  # float16 or float32 [out, groups / k]
    group_size: int
    offset: torch.Tensor | None = None  # float16 or float32 [out, groups / k], or none (0)
    scale_codes: torch.Tensor | None = None  # int8 [out, groups], or none
    offset_codes: torch.Tensor | None = None  # int8 [out, groups], or none

    method = "int8_group"

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def nbytes(self) -> int:
        return _nbytes(self.codes, self.scale, self.offset, self.scale_codes, self.offset_codes)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        out, features = self.shape
        groups = features // self.group_size
        w = self.codes.float().view(out, groups, self.group_size) * group_values(
            self.scale, self.scale_codes, groups)[..., None]
        if self.offset is not None:
            w = w + group_values(self.offset, self.offset_codes, groups)[..., None]
        return w.view(out, features).to(dtype)

    def rows(self, start: int, end: int) -> Int8GroupWeight:
        """Output channels ``[start, end)`` (views of this weight's tensors)."""
        return select_rows(self, slice(start, end))


QuantizedWeight = Int8Weight | Int4Weight | Int8GroupWeight

METHODS = ("int8", "int4")


@dataclass(frozen=True, slots=True)
class Quantization:
    """What to quantize a model's weights to: ``method`` (``int8`` or ``int4``), the int4 group
    size, and whether the LM head is quantized too (to int8, whatever ``method``). A layer whose
    inputs the group size does not divide is quantized to int8 instead (``method_for``), as
    llama.cpp falls back to another type for rows its blocks do not tile."""

    method: str
    group_size: int = 32
    lm_head: bool = False

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"quantization must be one of {', '.join(METHODS)} (or None), "
                             f"got {self.method!r}")
        if self.method == "int4" and (not isinstance(self.group_size, int) or self.group_size < 2
                                      or self.group_size % 2):
            raise ValueError(f"quantization_group_size must be a positive even integer, got "
                             f"{self.group_size!r}")

    def describe(self) -> str:
        """What the weights are quantized to, in words: ``int8`` or ``int4 (group 32)``."""
        return self.method if self.method == "int8" else f"{self.method} (group {self.group_size})"

    def method_for(self, in_features: int) -> str:
        """The layout a layer of ``in_features`` inputs is quantized to."""
        return "int4" if self.method == "int4" and in_features % self.group_size == 0 else "int8"


CHUNK_ELEMENTS = 1 << 20  # weights quantized at a time: float32 temporaries stay a few MiB


def chunks(rows: int, features: int) -> list[tuple[int, int]]:
    """Row ranges of at most ``CHUNK_ELEMENTS`` weights (at least one row each)."""
    step = max(1, CHUNK_ELEMENTS // features)
    return [(start, min(start + step, rows)) for start in range(0, rows, step)]


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """Symmetric per-output-channel int8 codes of a float weight ``[out, in]``."""
    out, features = weight.shape
    codes = torch.empty(out, features, dtype=torch.int8)
    scale = torch.empty(out, dtype=torch.float32)
    for start, end in chunks(out, features):
        w = weight[start:end].detach().float()
        s = w.abs().amax(1) / INT8_MAX
        s = torch.where(s > 0, s, torch.ones_like(s))
        codes[start:end] = torch.round(w / s[:, None]).clamp_(-INT8_MAX, INT8_MAX)
        scale[start:end] = s
    return Int8Weight(codes, scale)


def quantize_int4(weight: torch.Tensor, group_size: int) -> Int4Weight:
    """Asymmetric int4 codes of a float weight ``[out, in]`` in groups of ``group_size`` inputs."""
    out, features = weight.shape
    if features % group_size:
        raise ValueError(f"int4 groups of {group_size} do not tile {features} inputs")
    groups = features // group_size
    packed = torch.empty(out, features // 2, dtype=torch.uint8)
    scale = torch.empty(out, groups, dtype=torch.float16)
    offset = torch.empty(out, groups, dtype=torch.float16)
    for start, end in chunks(out, features):
        w = weight[start:end].detach().float().view(end - start, groups, group_size)
        low = w.amin(-1).half()
        s = ((w.amax(-1) - low.float()) / INT4_MAX).half()
        s = torch.where(s > 0, s, torch.ones_like(s))
        codes = torch.round((w - low.float()[..., None]) / s.float()[..., None])
        codes = codes.clamp_(0, INT4_MAX).to(torch.uint8).view(end - start, features // 2, 2)
        packed[start:end] = codes[..., 0] | (codes[..., 1] << 4)
        scale[start:end], offset[start:end] = s, low
    return Int4Weight(packed, scale, offset, group_size)


def quantize(weight: torch.Tensor, quantization: Quantization) -> QuantizedWeight:
    """``weight`` ``[out, in]`` in the layout ``quantization`` gives a layer of its inputs."""
    if quantization.method_for(weight.shape[1]) == "int8":
        return quantize_int8(weight)
    return quantize_int4(weight, quantization.group_size)


def _structure(weight: QuantizedWeight) -> tuple:
    """What two weights must share to be one weight: layout, group size, and each group value's
    dtype and levels."""
    parts = [getattr(weight, name, None) for name in ("scale", "offset", "scale_codes", "offset_codes")]
    return (type(weight), getattr(weight, "group_size", 0),
            *[(None if t is None else (t.dtype, tuple(t.shape[1:]))) for t in parts])


def concatenable(weights: list[QuantizedWeight]) -> bool:
    """Whether ``weights`` share one layout, group size and kind of group values (``concatenate``
    takes them)."""
    return len({_structure(w) for w in weights}) == 1


def select_rows(weight: QuantizedWeight, index: torch.Tensor | slice) -> QuantizedWeight:
    """The weight whose output channel ``j`` is ``weight``'s channel ``index[j]`` (a reordering of
    whole rows: every code, scale and offset moves with its row; a slice gives views). A tensor
    two fields share stays one."""
    values = {name: getattr(weight, name) for name in weight.__slots__}
    selected = {id(v): v[index] for v in values.values() if isinstance(v, torch.Tensor)}
    return type(weight)(**{name: selected[id(v)] if isinstance(v, torch.Tensor) else v
                           for name, v in values.items()})


def concatenate(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """One weight whose output channels are those of ``weights`` in order (``concatenable`` ones):
    the layers of one input, run as one GEMM."""
    if not concatenable(weights):
        raise ValueError("cannot concatenate quantized weights of different layouts")
    first = weights[0]
    values = {name: getattr(first, name) for name in first.__slots__}
    joined: dict[tuple, torch.Tensor] = {}  # fields that hold one tensor in every weight stay one
    for name, value in values.items():
        if isinstance(value, torch.Tensor):
            parts = [getattr(w, name) for w in weights]
            key = tuple((t.data_ptr(), t.shape) for t in parts)
            values[name] = joined[key] if key in joined else joined.setdefault(key, torch.cat(parts))
    return type(first)(**values)
