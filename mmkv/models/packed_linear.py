"""Linear layers whose weights are packed once, at load, for the CPU's GEMM, each row count run
the way this machine runs it fastest.

``F.linear`` on the CPU goes through MKL, which re-lays-out (packs) the weight on every call and,
on AMD processors, does not take the AVX-512 path; at decode shapes (a few rows against every
weight of the model) that costs more than the arithmetic. oneDNN's linear with a weight reordered
once into its blocked layout avoids both (``python -m mmkv.bench prefix --json`` measures the
end-to-end effect).

oneDNN's bfloat16 path needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT. On a processor with AVX2 alone
it refuses to reorder a bfloat16 weight, and ``F.linear`` in bfloat16 there has no fast path: it
runs slower than in float32. So there a bfloat16 weight is packed *upcast*: its values, exact in
float32, are packed as a float32 weight, each call's rows are upcast and its outputs rounded back
to bfloat16. The products of bfloat16 values are exact in float32 and the sums run in float32 as in
the bfloat16 path, so the outputs are the bfloat16 layer's up to the order of the sums; the weight
takes float32's memory (the KV cache stays bfloat16).

Which is faster for a few rows depends on the machine: a oneDNN call has a fixed cost that can
exceed a small ``F.linear``'s, and MKL spreading a few rows over every core can cost more than it
saves. So a small float32 weight (which keeps its plain copy, at most 1.6 MB) is *calibrated* when
first met: for every row class (1, 2, ..., 16, 17-32, ..., 129-256 rows, while the class's work
stays small) its three ways, oneDNN packed, ``F.linear`` on the step's threads and ``F.linear``
with MKL on the calling thread alone (``MKL_Set_Num_Threads_Local``, which leaves OpenMP's team,
and so the attention kernel and every other operation, as it is), are timed in turns, and the
fastest median is that class's way. Weights of one shape, dtype and thread count share one
calibration per process. Larger row counts and larger weights run packed.

Guarantees: ``PackedLinear(w, b)(x)`` equals ``F.linear(x, w, b)`` up to float rounding (the sums
run in another order: about 1e-6 relative in float32) whichever way a row count runs; it holds the
packed copy only (but for small float32 weights), so a model whose weights are packed takes no
more memory than unpacked (but bfloat16 weights packed upcast, which take float32's). What these
choices measured: docs/attention-and-kernels.md.
"""

from __future__ import annotations

import ctypes
import functools
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def packing_available(weight: torch.Tensor) -> bool:
    """Whether oneDNN can run this weight's layer: a CPU tensor in float32 or bfloat16."""
    return (weight.device.type == "cpu" and weight.dtype in PACKABLE_DTYPES
            and torch.backends.mkldnn.is_available())


def bfloat16_packs() -> bool:
    """Whether oneDNN packs bfloat16 weights as they are on this processor (else upcast)."""
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


PLAIN_COPY_ELEMENTS = 400_000  # a float32 weight this small keeps its plain copy (1.6 MB)
CALIBRATED_ROWS = 256  # row counts up to this run the way calibration chose; more run packed
CALIBRATION_WORK = 1 << 23  # ... while rows x weight elements stay within this
CALIBRATION_TURNS = 7  # timed calls of each way per row class (the median counts)
PACKED, PLAIN, ONE_THREAD = "packed", "plain", "one_thread"  # the ways a row class runs


def padded_rows(rows: int) -> int:
    """The row count a packed layer runs ``rows`` rows at: every count up to 16, then the next
    multiple of an eighth of the power of two below it (at most 8 counts per doubling, at most
    1/8 more rows). oneDNN builds a primitive for every row count it meets, once, at many times
    a warm call's cost, and speculative verification meets a new count almost every round (the
    sum of the sequences' drafts): padding bounds the counts a process ever builds for."""
    if rows <= 16:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


_BUILT: set[tuple[int, int, int]] = set()  # (padded rows, out, in) a packed layer has run at


def kernel_builds() -> int:
    """How many (row count, weight shape) pairs packed layers have run at in this process: when
    it moves across a pass, oneDNN built a kernel in it, and that pass took far longer than the
    next one of its shape will."""
    return len(_BUILT)


SINGLE_ROW_CLASSES = 16  # row counts up to this are classes of their own; then 17-32, 33-64, ...


def row_class(rows: int) -> int:
    """The class of a row count: ``rows - 1`` up to ``SINGLE_ROW_CLASSES`` rows (a speculative
    verification's rows at batch 1: where the fastest way changes from one count to the next),
    then one class per doubling (16 for 17-32 rows, 17 for 33-64, ...)."""
    if rows <= SINGLE_ROW_CLASSES:
        return rows - 1
    return SINGLE_ROW_CLASSES + (rows - 1).bit_length() - SINGLE_ROW_CLASSES.bit_length()


def class_rows(c: int) -> int:
    """The row count a class is timed at: its own, or the middle of its doubling."""
    if c < SINGLE_ROW_CLASSES:
        return c + 1
    high = SINGLE_ROW_CLASSES << (c - SINGLE_ROW_CLASSES + 1)
    return (high // 2 + 1 + high) // 2


@functools.cache
def _mkl_local_threads() -> Callable[[int], int] | None:
    """MKL's setter of the calling thread's own thread count (0: back to the global one), where
    torch links MKL into ``libtorch_cpu`` (its x86 builds), else None."""
    if not torch.backends.mkl.is_available():
        return None
    for library in sorted((Path(torch.__file__).parent / "lib").glob("libtorch_cpu.*")):
        try:
            setter = ctypes.CDLL(str(library)).MKL_Set_Num_Threads_Local
        except (OSError, AttributeError):
            continue
        setter.argtypes, setter.restype = [ctypes.c_int], ctypes.c_int
        return setter
    return None


_CALIBRATED: dict[tuple, tuple[str, ...]] = {}  # (shape, dtype, bias, threads) -> way per row class


class PackedLinear:
    """``y = x @ weight.T + bias`` with the weight in oneDNN's layout. A float32 weight small
    enough for ``F.linear`` to win on few rows keeps its plain copy too (at most 1.6 MB), and each
    row class runs the way calibration measured fastest (the module docstring). A bfloat16 weight
    on a processor without oneDNN's bfloat16 path runs as its float32 upcast (``upcast``)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        weight = weight.detach().contiguous()
        self.upcast = weight.dtype == torch.bfloat16 and not bfloat16_packs()
        if self.upcast:
            weight = weight.float()
            bias = None if bias is None else bias.float()
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight)
        self.bias = None if bias is None else bias.detach()
        self.elements = weight.numel()
        self.shape = tuple(weight.shape)
        self.row_counts: set[int] = set()  # the padded row counts this layer has run at
        small = weight.dtype == torch.float32 and self.elements <= PLAIN_COPY_ELEMENTS
        self.plain = weight if small else None
        self.ways: tuple[str, ...] = ()  # per row class; classes past the end run packed
        if small:
            key = (self.shape, weight.dtype, bias is not None, torch.get_num_threads())
            if key not in _CALIBRATED:
                _CALIBRATED[key] = self.calibrate()
            self.ways = _CALIBRATED[key]

    def calibrate(self, clock: Callable[[], float] = time.perf_counter) -> tuple[str, ...]:
        """The fastest way for each row class whose work is within ``CALIBRATION_WORK``, timed on
        ``clock``: every way once per turn, ``CALIBRATION_TURNS`` turns after a warm-up call."""
        ways = [PACKED, PLAIN] + ([ONE_THREAD] if _mkl_local_threads() is not None else [])
        chosen = []
        with torch.inference_mode():
            for c in range(row_class(CALIBRATED_ROWS) + 1):
                rows = class_rows(c)
                if rows * self.elements > CALIBRATION_WORK:
                    break
                x = torch.randn(rows, self.shape[1], dtype=self.plain.dtype)
                seconds: dict[str, list[float]] = {way: [] for way in ways}
                for turn in range(CALIBRATION_TURNS + 1):
                    for way in ways:
                        start = clock()
                        self.run(x, way)
                        if turn:
                            seconds[way].append(clock() - start)
                chosen.append(min(ways, key=lambda way: statistics.median(seconds[way])))
        return tuple(chosen)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        c = row_class(x.shape[0])
        way = self.ways[c] if c < len(self.ways) else PACKED
        if self.upcast:
            return self.run(x.float(), way).to(x.dtype)
        return self.run(x, way)

    def run(self, x: torch.Tensor, way: str) -> torch.Tensor:
        """The rows ``x`` through the layer the given way."""
        if way == PLAIN:
            return F.linear(x, self.plain, self.bias)
        if way == ONE_THREAD:
            setter = _mkl_local_threads()
            setter(1)  # MKL on this thread alone, until the call returns
            try:
                return F.linear(x, self.plain, self.bias)
            finally:
                setter(0)
        rows = x.shape[0]
        padded = padded_rows(rows)
        if padded not in self.row_counts:  # a set of ints here; the shared set only when new
            self.row_counts.add(padded)
            _BUILT.add((padded, *self.shape))
        if padded == rows:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])  # F.pad also fills x's rows first
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")[:rows]


class PlainLinear:
    """``F.linear`` (every device; bit for bit what transformers' modules compute)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, pack: bool) -> PackedLinear | PlainLinear:
    """A packed layer where ``pack`` is asked for and oneDNN can run it, else ``F.linear``."""
    if pack and packing_available(weight):
        return PackedLinear(weight, bias)
    return PlainLinear(weight, bias)


def release(*modules: torch.nn.Linear) -> None:
    """Drop modules' own copies of weights that live packed elsewhere now (the modules can no
    longer run; the fused layers and the head that replaced them do)."""
    for module in modules:
        module.weight.data = module.weight.data.new_empty(0)
