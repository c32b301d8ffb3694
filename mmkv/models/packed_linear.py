"""Linear layers whose weights are packed once, at load, for the CPU's GEMM.

``F.linear`` on the CPU goes through MKL, which re-lays-out (packs) the weight on every call and,
on AMD processors, does not take the AVX-512 path; at decode shapes (a few rows against every
weight of the model) that costs more than the arithmetic. oneDNN's linear with a weight reordered
once into its blocked layout avoids both: on this project's 2-core AMD EPYC machine it runs the
benchmark model's layers 2.3-2.6x faster in float32 (decode and prefill shapes) and 1.1-1.4x in
bfloat16 (``python -m mmkv.bench prefix`` gives the end-to-end figures).

Guarantees: ``PackedLinear(w, b)(x)`` equals ``F.linear(x, w, b)`` up to float rounding (the sums
run in another order: about 1e-6 relative in float32); it holds the packed copy only (but for
small float32 weights), so a model whose weights are packed takes no more memory than before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def packing_available(weight: torch.Tensor) -> bool:
    """Whether oneDNN can run this weight's layer: a CPU tensor in float32 or bfloat16."""
    return (weight.device.type == "cpu" and weight.dtype in PACKABLE_DTYPES
            and torch.backends.mkldnn.is_available())


# oneDNN's call costs about 15 us whatever the size; in float32, F.linear is faster while
# rows x weight elements stay under this (measured on the 2-core AMD EPYC: a 512 x 512 weight
# takes 14 us plain, 18 us packed for one row; 49 us and 24 us for eight).
PLAIN_FLOAT32_WORK = 400_000


def padded_rows(rows: int) -> int:
    """The row count a packed layer runs ``rows`` rows at: every count up to 16, then the next
    multiple of an eighth of the power of two below it (at most 8 counts per doubling, at most
    1/8 more rows). oneDNN builds a primitive for every row count it meets, once, for 250-700 us
    (a warm call at decode shapes takes 10-40 us); speculative verification meets a new count
    almost every round (the sum of the sequences' drafts), and its passes took twice as long as
    those of one repeated count."""
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


class PackedLinear:
    """``y = x @ weight.T + bias`` with the weight in oneDNN's layout. A float32 weight small
    enough for ``F.linear`` to win on few rows keeps its plain copy too (at most 1.6 MB)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        weight = weight.detach().contiguous()
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight)
        self.bias = None if bias is None else bias.detach()
        self.elements = weight.numel()
        self.shape = tuple(weight.shape)
        self.row_counts: set[int] = set()  # the padded row counts this layer has run at
        small = weight.dtype == torch.float32 and self.elements <= PLAIN_FLOAT32_WORK
        self.plain = weight if small else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.plain is not None and rows * self.elements <= PLAIN_FLOAT32_WORK:
            return F.linear(x, self.plain, self.bias)
        padded = padded_rows(rows)
        if padded not in self.row_counts:  # a set of ints here; the shared set only when new
            self.row_counts.add(padded)
            _BUILT.add((padded, *self.shape))
        if padded == rows:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        x = F.pad(x, (0, 0, 0, padded - rows))
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
