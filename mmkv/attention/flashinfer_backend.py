"""FlashInfer attention over the paged KV cache (NVIDIA GPUs, float16 or bfloat16).

Per step, one ``plan()`` per attention pattern from host int32 arrays built from the step's
metadata; per layer, one ``run()`` on that layer's cache tensor, which is FlashInfer's NHD layout
as it is. Each pattern has a wrapper of its own; all share one float workspace:

* ``prefill``: any step with a sequence of more than one new token (prompt chunks, speculative
  verification, decodes mixed in): ``BatchPrefillWithPagedKVCacheWrapper`` (fa2), causal. Its mask
  is bottom-right aligned and the step's K/V are appended first, so new token ``i`` of a sequence
  sees the sequence's context and its new tokens up to ``i``.
* ``decode``: one new token per sequence: ``BatchDecodeWithPagedKVCacheWrapper`` on tensor cores.
* ``shared`` (cascade): sequences the metadata groups by shared full pages attend those pages once
  per group (a prefill wrapper, not causal: every query of the group comes after them) and their
  own pages through ``prefill`` or ``decode``; the two states merge by their base-2 log-sum-exp
  (``merge_state``). Equal to causal attention over the whole sequence.
* ``cross``: image cross-attention, a prefill wrapper planned not causal over each image group's
  pages, trimmed to the positions any row sees, with a custom mask only where rows differ.

New K/V go in with ``append_paged_kv_cache`` and the post-append page table (positions are the
metadata's, i.e. post-append length minus new tokens plus offset), cast to the pool's dtype. An
fp8 pool (``kv_cache_dtype="fp8_e4m3"``) is FlashInfer's own fp8 KV: the plans say ``kv_data_type``
float8_e4m3fn and the runs leave ``k_scale`` / ``v_scale`` at 1 (``cache.kv_format``); int8 pools
are the CPU's alone.

Every FlashInfer call is built as a ``Call`` by the plain functions below, which run anywhere (a
CPU included) and read no device tensor on the host, so tests bind each call against FlashInfer's
own signatures without a GPU; ``FlashInferBackend`` only executes them.

Invariant: for the same pages and metadata the output equals the torch backend's up to rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Collection, NamedTuple

import torch

from cache import kv_format
from mmkv.attention.metadata import CascadeGroup, CrossBatch, PagedBatch
from mmkv.step_context import AttentionBackend, StepContext

VERSION = "0.7.4"  # the flashinfer-python release these calls are written (and checked) against
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
WORKSPACE_BYTES = 256 << 20  # split-KV scratch shared by every wrapper (128 MiB overflows on big batches)
PREFILL = "BatchPrefillWithPagedKVCacheWrapper"
DECODE = "BatchDecodeWithPagedKVCacheWrapper"
PATTERNS = {"prefill": PREFILL, "decode": DECODE, "shared": PREFILL, "cross": PREFILL}


class Call(NamedTuple):
    """One FlashInfer call. ``target`` names a function (``append_paged_kv_cache``) or a wrapper
    class and method (``BatchPrefillWithPagedKVCacheWrapper.plan``; ``.__init__`` builds one)."""

    target: str
    args: tuple
    kwargs: dict


@dataclass(frozen=True, slots=True)
class Heads:
    """A model's attention shape and options: with the step's metadata, all a plan depends on."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    scale: float
    window: int | None = None

    @classmethod
    def of(cls, query: torch.Tensor, layer: torch.Tensor, scale: float,
           window: int | None = None) -> Heads:
        """For queries ``[T, q_heads, head_dim]`` over a cache ``[P, 2, page, kv_heads, head_dim]``."""
        _, _, page, kv_heads, head_dim = layer.shape
        return cls(query.shape[1], kv_heads, head_dim, page, query.dtype, layer.dtype, scale, window)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size


class SelfPlan(NamedTuple):
    """A step's self-attention: ``main`` (pattern ``prefill`` or ``decode``) over each sequence's
    own pages (those after its group's shared ones, with cascade); with cascade, ``shared`` over
    each group's shared pages for the query rows ``shared_rows`` (``None``: all rows, in order),
    merged into ``main``'s result."""

    pattern: str
    main: Call
    shared: Call | None
    shared_rows: torch.Tensor | None


class CrossPlan(NamedTuple):
    """A step's cross-attention: ``plan`` attends the query rows ``rows`` (device, group after
    group); every other row's output is zero."""

    plan: Call
    rows: torch.Tensor


class AppendIndex(NamedTuple):
    """Where new K/V go, as ``append_paged_kv_cache`` takes it (int32, on the cache's device):
    each new token's request and position, and the post-append page table."""

    batch_indices: torch.Tensor
    positions: torch.Tensor
    kv_indices: torch.Tensor
    kv_indptr: torch.Tensor
    kv_last_page_len: torch.Tensor


def unsupported(device: torch.device, dtype: torch.dtype, head_dim: int,
                kv_dtypes: Collection[torch.dtype] = ()) -> list[str]:
    """What keeps FlashInfer from serving a model of ``dtype`` and ``head_dim`` on ``device``
    with cache layers of ``kv_dtypes`` (default: the model's)."""
    problems = []
    if torch.int8 in kv_dtypes:
        problems.append("it reads fp8 KV but not int8 (pass kv_cache_dtype='fp8_e4m3')")
    if torch.device(device).type != "cuda":
        problems.append(f"it runs on CUDA devices only, this engine's device is {device}")
    if dtype not in SUPPORTED_DTYPES:
        problems.append(f"it computes in float16 or bfloat16 only, this model's dtype is "
                        f"{str(dtype).removeprefix('torch.')} (pass dtype='bfloat16')")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        problems.append(f"head_dim must be one of {', '.join(map(str, SUPPORTED_HEAD_DIMS))}, "
                        f"this model's is {head_dim}")
    return problems


def check_supported(device: torch.device, dtype: torch.dtype, head_dim: int,
                    kv_dtypes: Collection[torch.dtype] = ()) -> None:
    problems = unsupported(device, dtype, head_dim, kv_dtypes)
    if problems:
        raise ValueError("attention_backend='flashinfer' cannot serve this engine: "
                         + "; ".join(problems) + " (attention_backend='torch' runs anywhere)")


def _i32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _window_left(window: int | None, kv_lens: list[int]) -> int:
    """FlashInfer's ``window_left`` (keys ``[q - window_left, q]``) for a window of ``window`` keys
    ending at the query; -1 (no window, no sliding-window kernel) when it covers every sequence."""
    return window - 1 if window is not None and max(kv_lens) > window else -1


def wrapper_call(pattern: str, workspace: torch.Tensor) -> Call:
    """The constructor of ``pattern``'s wrapper over the shared ``workspace``."""
    if pattern == "decode":
        return Call(f"{DECODE}.__init__", (workspace, "NHD"),
                    {"use_tensor_cores": True, "backend": "fa2"})
    return Call(f"{PREFILL}.__init__", (workspace, "NHD"), {"backend": "fa2"})


def _dtypes(heads: Heads) -> dict:
    return {"sm_scale": heads.scale, "q_data_type": heads.q_dtype, "kv_data_type": heads.kv_dtype}


def prefill_plan(qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                 kv_last_page_len: torch.Tensor, heads: Heads, causal: bool, window_left: int = -1,
                 custom_mask: torch.Tensor | None = None) -> Call:
    options = {"causal": causal, "window_left": window_left, **_dtypes(heads)}
    if custom_mask is not None:
        options["custom_mask"] = custom_mask
    return Call(f"{PREFILL}.plan", (qo_indptr, kv_indptr, kv_indices, kv_last_page_len, *heads.shape),
                options)


def decode_plan(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor,
                heads: Heads, window_left: int = -1) -> Call:
    return Call(f"{DECODE}.plan", (kv_indptr, kv_indices, kv_last_page_len, *heads.shape),
                {"window_left": window_left, **_dtypes(heads)})


def run_call(pattern: str, query: torch.Tensor, layer: torch.Tensor, return_lse: bool) -> Call:
    return Call(f"{PATTERNS[pattern]}.run", (query, layer), {"return_lse": return_lse})


def merge_call(out: torch.Tensor, lse: torch.Tensor, out_other: torch.Tensor,
               lse_other: torch.Tensor) -> Call:
    return Call("merge_state", (out, lse, out_other, lse_other), {})


def append_call(key: torch.Tensor, value: torch.Tensor, index: AppendIndex,
                layer: torch.Tensor) -> Call:
    return Call("append_paged_kv_cache",
                (kv_format.encode(key, layer.dtype), kv_format.encode(value, layer.dtype),
                 index.batch_indices, index.positions,
                 layer, index.kv_indices, index.kv_indptr, index.kv_last_page_len),
                {"kv_layout": "NHD"})


def append_index(batch: PagedBatch) -> AppendIndex:
    """The step's K/V writes: token ``t`` of sequence ``b`` at its position, in ``b``'s pages."""
    device = batch.positions.device
    seq_of_token = torch.arange(len(batch.q_lens), dtype=torch.int32).repeat_interleave(
        torch.tensor(batch.q_lens))
    return AppendIndex(seq_of_token.to(device), batch.positions.to(torch.int32), batch.kv_indices,
                       batch.kv_indptr, batch.kv_last_page_len)


def image_append_index(pages: list[int], start: int, end: int, block_size: int,
                       device: torch.device) -> AppendIndex:
    """An image's positions ``start .. end - 1``: one request whose table ends at ``end``."""
    n = -(-end // block_size)
    index = (torch.zeros(end - start, dtype=torch.int32), torch.arange(start, end, dtype=torch.int32),
             _i32(pages[:n]), _i32([0, n]), _i32([end - (n - 1) * block_size]))
    return AppendIndex(*(t.to(device) for t in index))


def _suffix_pages(batch: PagedBatch, groups: list[CascadeGroup]) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv_indptr`` and ``kv_indices`` (host) of each sequence's pages after its shared ones."""
    host = batch.host
    skip = torch.zeros(len(batch.q_lens), dtype=torch.int32)
    for group in groups:
        skip[group.seqs] = group.num_pages
    counts = host.kv_indptr[1:] - host.kv_indptr[:-1]
    offset = torch.arange(host.kv_indices.shape[0], dtype=torch.int32) \
        - host.kv_indptr[:-1].repeat_interleave(counts)
    indptr = torch.zeros_like(host.kv_indptr)
    indptr[1:] = torch.cumsum(counts - skip, 0)
    return indptr, host.kv_indices[offset >= skip.repeat_interleave(counts)]


def _shared_plan(batch: PagedBatch, groups: list[CascadeGroup],
                 heads: Heads) -> tuple[Call, torch.Tensor | None]:
    """Level 0 of the cascade: per group one request, its members' query rows against the
    shared pages, not causal."""
    qo_bounds = batch.host.qo_indptr.tolist()
    kv_bounds = batch.host.kv_indptr.tolist()
    indices = batch.host.kv_indices
    rows: list[int] = []
    qo, kv, pages = [0], [0], []
    for group in groups:
        for s in group.seqs:
            rows.extend(range(qo_bounds[s], qo_bounds[s + 1]))
        qo.append(len(rows))
        kv.append(kv[-1] + group.num_pages)
        first = kv_bounds[group.seqs[0]]
        pages.append(indices[first:first + group.num_pages])
    plan = prefill_plan(_i32(qo), _i32(kv), torch.cat(pages), _i32([batch.block_size] * len(groups)),
                        heads, causal=False)
    if rows == list(range(qo_bounds[-1])):
        return plan, None
    return plan, torch.tensor(rows, dtype=torch.long, device=batch.positions.device)


def plan_self_attention(batch: PagedBatch, heads: Heads) -> SelfPlan:
    """How ``batch``'s self-attention runs for a model of ``heads``."""
    groups = batch.cascade_groups
    window_left = _window_left(heads.window, batch.kv_lens)
    if groups and window_left >= 0:
        raise ValueError("cascade plans need a window covering every sequence; plan without cascade")
    host = batch.host
    kv_indptr, kv_indices = _suffix_pages(batch, groups) if groups else (host.kv_indptr, host.kv_indices)
    if all(q == 1 for q in batch.q_lens):
        pattern, main = "decode", decode_plan(kv_indptr, kv_indices, host.kv_last_page_len, heads,
                                              window_left)
    else:
        pattern, main = "prefill", prefill_plan(host.qo_indptr, kv_indptr, kv_indices,
                                                host.kv_last_page_len, heads, True, window_left)
    if not groups:
        return SelfPlan(pattern, main, None, None)
    return SelfPlan(pattern, main, *_shared_plan(batch, groups, heads))


def plan_cross_attention(cross: CrossBatch, heads: Heads) -> CrossPlan:
    """Per image group one request: its rows against its pages up to the last position any row
    sees; the groups' masks (row-major per request) only when some row sees less than that."""
    bs = heads.page_size
    qo, kv, pages, last = [0], [0], [], []
    for group in cross.groups:
        n = -(-group.visible_len // bs)
        qo.append(qo[-1] + len(group.row_list))
        kv.append(kv[-1] + n)
        pages.extend(group.page_list[:n])
        last.append(group.visible_len - (n - 1) * bs)
    mask = None if all(g.uniform for g in cross.groups) else torch.cat(
        [g.allowed[:, :g.visible_len].reshape(-1) for g in cross.groups])
    plan = prefill_plan(_i32(qo), _i32(kv), _i32(pages), _i32(last), heads, False, custom_mask=mask)
    return CrossPlan(plan, torch.cat([g.rows for g in cross.groups]))


def import_flashinfer() -> ModuleType:
    try:
        import flashinfer
    except ImportError as err:
        raise ValueError(f"attention_backend='flashinfer' needs flashinfer-python=={VERSION} "
                         f"(pip install 'mmkv[gpu]'): {err}") from err
    return flashinfer


class FlashInferBackend(AttentionBackend):
    """Executes the calls built above with ``kernels`` (the ``flashinfer`` module, or any module
    with the same API). Guarantees: a wrapper is planned at most once per step and pattern
    (again only when another step or model planned it in between), and never runs on another
    step's plan."""

    name = "flashinfer"

    def __init__(self, device: torch.device, kernels: ModuleType | None = None,
                 workspace_bytes: int = WORKSPACE_BYTES) -> None:
        self.kernels = kernels if kernels is not None else import_flashinfer()
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=device)
        self._wrappers: dict[tuple, object] = {}
        self._holding: dict[tuple, Call] = {}  # the plan each wrapper holds

    def _call(self, call: Call, wrapper: object | None = None):
        if wrapper is None:
            return getattr(self.kernels, call.target)(*call.args, **call.kwargs)
        return getattr(wrapper, call.target.rsplit(".", 1)[1])(*call.args, **call.kwargs)

    def _planned(self, pattern: str, heads: Heads, plan: Call) -> object:
        """``pattern``'s wrapper for models of ``heads``' shape, holding ``plan``."""
        key = (pattern, *heads.shape)
        wrapper = self._wrappers.get(key)
        if wrapper is None:
            init = wrapper_call(pattern, self.workspace)
            cls = getattr(self.kernels, init.target.split(".")[0])
            wrapper = self._wrappers[key] = cls(*init.args, **init.kwargs)
        if self._holding.get(key) is not plan:
            self._call(plan, wrapper)
            self._holding[key] = plan
        return wrapper

    def write_kv(self, step: StepContext, layer: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor) -> None:
        index = step.plans.get("append")
        if index is None:
            index = step.plans["append"] = append_index(step.batch)
        self._call(append_call(key, value, index, layer))

    def attention(self, step: StepContext, query: torch.Tensor, layer: torch.Tensor, scale: float,
                  sliding_window: int | None) -> torch.Tensor:
        heads = Heads.of(query, layer, scale, sliding_window)
        plan = step.plans.get(heads)
        if plan is None:
            plan = step.plans[heads] = plan_self_attention(step.batch, heads)
        query = query.contiguous()
        wrapper = self._planned(plan.pattern, heads, plan.main)
        if plan.shared is None:
            return self._call(run_call(plan.pattern, query, layer, False), wrapper)
        out, lse = self._call(run_call(plan.pattern, query, layer, True), wrapper)
        shared = self._planned("shared", heads, plan.shared)
        rows = plan.shared_rows
        if rows is None:
            s_out, s_lse = self._call(run_call("shared", query, layer, True), shared)
            return self._call(merge_call(out, lse, s_out, s_lse))[0]
        s_out, s_lse = self._call(run_call("shared", query.index_select(0, rows), layer, True), shared)
        merged, _ = self._call(merge_call(out.index_select(0, rows), lse.index_select(0, rows),
                                          s_out, s_lse))
        return out.index_copy_(0, rows, merged)

    def cross_attention(self, step: StepContext, query: torch.Tensor, layer: torch.Tensor,
                        scale: float) -> torch.Tensor:
        heads = Heads.of(query, layer, scale)
        plan = step.plans.get(("cross", heads))
        if plan is None:
            plan = step.plans[("cross", heads)] = plan_cross_attention(step.cross, heads)
        wrapper = self._planned("cross", heads, plan.plan)
        out = self._call(run_call("cross", query.index_select(0, plan.rows), layer, False), wrapper)
        return torch.zeros_like(query).index_copy_(0, plan.rows, out)

    def write_image_kv(self, layer: torch.Tensor, pages: list[int], start: int, key: torch.Tensor,
                       value: torch.Tensor) -> None:
        index = image_append_index(pages, start, start + key.shape[0], layer.shape[2], layer.device)
        self._call(append_call(key, value, index, layer))
