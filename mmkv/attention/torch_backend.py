"""Reference attention over the paged KV cache, in plain torch (CPU and any device).

Reads exactly the metadata FlashInfer's kernels receive (``PagedBatch``). Sequences with many new
tokens (prompt chunks) are attended one at a time with torch's SDPA (queries in chunks, so memory
stays bounded for long prompts; a chunk after earlier ones attends the keys before it unmasked and
its own square causally, merged by log-sum-exp, so no score above the diagonal is computed);
those with a few (decode steps, speculative verification) are attended together, their queries
padded to the longest. Decode groups that share leading pages attend those pages once for the
whole group and merge with each sequence's own pages by log-sum-exp, which gives the same result
as attending the concatenation. On the CPU, where the native kernel is built (``native.py``), a
decode group's own pages are attended in place by it, starting from the shared pages' state, with
no copy, padding or merge.

Guarantees: output equals dense causal attention (with the sliding window, when given) over the
sequence's KV, up to floating-point rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cache import kv_format
from mmkv.attention import native
from mmkv.attention.metadata import CascadeGroup, CrossBatch, DecodePlan, PagedBatch
from mmkv.step_context import AttentionBackend, StepContext

QUERY_CHUNK = 2048
SPLIT_QUERIES = 256  # from this many queries on, attending past keys and the diagonal apart pays
KEPT_MASK_ELEMENTS = 1 << 20  # a prompt chunk's mask up to this size is built once a step (4 MiB)


def write_kv(layer: torch.Tensor, batch: PagedBatch, key: torch.Tensor, value: torch.Tensor) -> None:
    """Store the step's new K/V ``[T, kv_heads, head_dim]`` into their pages, encoded in the layer's
    format (``cache.kv_format``) in the same pass: one copy into the layer's rows
    (``write_slots``), not an advanced-index write for K and another for V."""
    rows = layer.view(-1, *layer.shape[3:])
    store_rows(rows, batch.write_slots, kv_format.encode(torch.cat((key, value)), layer.dtype))


def store_rows(rows: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """``rows[index] = values`` along dim 0 (fp8 as bytes: torch's CPU copy has no fp8 kernel)."""
    if rows.dtype == torch.float8_e4m3fn:
        rows, values = rows.view(torch.uint8), values.view(torch.uint8)
    rows.index_copy_(0, index, values)


def gather_kv(layer: torch.Tensor, pages: torch.Tensor, length: int,
              dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[length, kv_heads, head_dim]`` of a page list (``index_select`` copies whole
    pages, cheaper than advanced indexing's per-element gather), in ``dtype`` if given; a
    compressed layer's are decoded (to ``dtype``, float32 by default), and only these ``length``
    tokens' rows."""
    k = layer[:, 0].index_select(0, pages).flatten(0, 1)[:length]
    v = layer[:, 1].index_select(0, pages).flatten(0, 1)[:length]
    if layer.dtype in kv_format.QUANTIZED.values():
        return kv_format.decode(k, dtype or torch.float32), kv_format.decode(v, dtype or torch.float32)
    return (k, v) if dtype in (None, layer.dtype) else (k.to(dtype), v.to(dtype))


def compute_dtype(query: torch.Tensor) -> torch.dtype:
    """Attention arithmetic runs in float32 on the CPU whatever the model's dtype: half-precision
    elementwise work is slower there, and the keys stay in the cache's dtype."""
    return torch.float32 if query.device.type == "cpu" else query.dtype


def attention(query: torch.Tensor, layer: torch.Tensor, batch: PagedBatch, scale: float,
              sliding_window: int | None = None, check_bounds: bool = False) -> torch.Tensor:
    """Attention output ``[T, q_heads, head_dim]`` for the packed queries ``[T, q_heads, head_dim]``
    (their K/V must already be written). ``check_bounds``: the native kernel checks its pages and
    lengths before it reads them (``native.paged_decode``)."""
    if sliding_window is not None and batch.cascade_groups and max(batch.kv_lens) > sliding_window:
        raise ValueError("cascade plans need a window covering every sequence; plan without cascade")
    dtype = compute_dtype(query)
    q_all = query.to(dtype)
    if not batch.prefill and len(batch.decode) == 1 and batch.decode[0].in_order:
        plan = batch.decode[0]  # every row in one plan, in order (decoding, a draft pass, a
        # verification with equal drafts): viewed in place, no gather, scatter or output buffer
        q = q_all.view(*plan.rows.shape, *q_all.shape[1:])
        return _decode(q, layer, plan, batch.block_size, scale, sliding_window,
                       check_bounds).reshape(query.shape).to(query.dtype)
    out = torch.empty_like(q_all)
    qo = batch.host.qo_indptr.tolist() if batch.prefill else None
    for i, pages in zip(batch.prefill, batch.prefill_pages):
        k, v = gather_kv(layer, pages, batch.kv_lens[i], dtype)
        start, end = qo[i], qo[i + 1]
        out[start:end] = _attend_one(q_all[start:end], k, v, batch.kv_lens[i], scale, sliding_window,
                                     batch.masks)
    for plan in batch.decode:
        out[plan.rows] = _decode(q_all[plan.rows], layer, plan, batch.block_size, scale, sliding_window,
                                 check_bounds)
    return out.to(query.dtype)


def _causal_mask(q_pos: torch.Tensor, kv_len: int, window: int | None) -> torch.Tensor:
    kv_pos = torch.arange(kv_len, device=q_pos.device)
    allowed = kv_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed &= kv_pos[None, :] > q_pos[:, None] - window
    return allowed


def _chunk_mask(first: int, rows: int, kv_len: int, window: int | None, like: torch.Tensor,
                masks: dict | None) -> torch.Tensor:
    """The additive mask (0 / -inf, ``like``'s dtype) of ``rows`` queries from position ``first``
    over ``kv_len`` keys. It is the same in every layer, so one of at most ``KEPT_MASK_ELEMENTS``
    is kept in ``masks`` (the step's ``PagedBatch.masks``) for the layers after the first; SDPA
    given a boolean mask would also turn it into this one at every call."""
    key = (first, rows, kv_len, window, like.dtype)
    if masks is not None and key in masks:
        return masks[key]
    allowed = _causal_mask(torch.arange(first, first + rows, device=like.device), kv_len, window)
    mask = torch.zeros(allowed.shape, dtype=like.dtype, device=like.device)
    mask.masked_fill_(~allowed, float("-inf"))
    if masks is not None and rows * kv_len <= KEPT_MASK_ELEMENTS:
        masks[key] = mask
    return mask


def _attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_len: int, scale: float,
                window: int | None, masks: dict | None = None) -> torch.Tensor:
    """One sequence's ``n`` queries (its last ``n`` positions) over its ``kv_len`` keys;
    ``masks``: the step's kept chunk masks (``_chunk_mask``)."""
    n = q.shape[0]
    kt, vt = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, H, L, D]
    if window is None and (n == 1 or n == kv_len) and n <= QUERY_CHUNK:  # no mask, or SDPA's causal one
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kt, vt, is_causal=n > 1,
                                           scale=scale, enable_gqa=True)
        return o[0].transpose(0, 1)
    if window is None and n >= SPLIT_QUERIES:
        return _attend_past_and_diagonal(q, kt, vt, kv_len, scale)
    out = torch.empty_like(q)
    for s in range(0, n, QUERY_CHUNK):
        e = min(s + QUERY_CHUNK, n)
        mask = _chunk_mask(kv_len - n + s, e - s, kv_len, window, q, masks)
        o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1)[None], kt, vt, attn_mask=mask,
                                           scale=scale, enable_gqa=True)
        out[s:e] = o[0].transpose(0, 1)
    return out


def _attend_past_and_diagonal(q: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor, kv_len: int,
                              scale: float) -> torch.Tensor:
    """Causal attention of the last ``n`` positions' queries without a mask: each chunk of queries
    sees every key before its first position in full and its own square causally, and the two
    parts merge by log-sum-exp. A masked kernel would compute (and then drop) every score above
    the diagonal; this computes none of them. ``kt``/``vt`` are ``[1, Hkv, L, D]``."""
    n, hq, dim = q.shape
    hkv = kt.shape[1]
    g = hq // hkv
    kt, vt = kt.expand(g, -1, -1, -1), vt.expand(g, -1, -1, -1)  # one batch row per query group
    out = torch.empty_like(q)
    for s in range(0, n, QUERY_CHUNK):
        e = min(s + QUERY_CHUNK, n)
        first = kv_len - n + s
        qc = q[s:e].reshape(e - s, hkv, g, dim).permute(2, 1, 0, 3)  # [G, Hkv, m, D]
        o, lse = _attend_with_lse(qc, kt[:, :, first:first + e - s], vt[:, :, first:first + e - s],
                                  None, scale, causal=True)
        if first:
            past, past_lse = _attend_with_lse(qc, kt[:, :, :first], vt[:, :, :first], None, scale)
            o = merge_states(past, past_lse, o, lse)
        out[s:e] = o.permute(2, 1, 0, 3).reshape(e - s, hq, dim)
    return out


def _decode(q: torch.Tensor, layer: torch.Tensor, plan: DecodePlan, block_size: int, scale: float,
            window: int | None, check_bounds: bool = False) -> torch.Tensor:
    """Attention of ``d`` sequences' short queries ``[d, m, Hq, D]`` (padded to ``m`` each)."""
    d, m, hq, dim = q.shape
    if native.supports(q, layer):
        return native.paged_decode(q, layer, plan.pages, plan.lens, plan.key_start, plan.positions,
                                   scale, window, _shared_state(q, layer, plan, block_size, scale),
                                   check_bounds)
    if d == 1 and not plan.groups:  # one sequence alone: no padding to mask, no states to merge
        k, v = gather_kv(layer, plan.pages[0], plan.host_lens[0], q.dtype)
        return _attend_one(q[0], k, v, plan.host_lens[0], scale, window)[None]
    hkv = layer.shape[3]
    length = plan.pages.shape[1] * block_size
    k, v = gather_kv(layer, plan.pages.view(-1), d * length, q.dtype)
    k = k.view(d, length, hkv, dim).transpose(1, 2)  # [d, Hkv, L, D]
    v = v.view(d, length, hkv, dim).transpose(1, 2)
    groups_q = _query_groups(q, hkv)
    out, lse = _attend_with_lse(groups_q, k, v, plan.bias(hq // hkv, window, block_size), scale)
    for group in plan.groups:
        s_out, s_lse = _attend_shared(groups_q[group.members], layer, group, block_size, scale)
        out[group.members] = merge_states(s_out, s_lse, out[group.members], lse[group.members])
    return out.view(d, hkv, m, hq // hkv, dim).transpose(1, 2).reshape(d, m, hq, dim)


def _query_groups(q: torch.Tensor, hkv: int) -> torch.Tensor:
    """Queries ``[d, m, Hq, D]`` as ``[d, Hkv, m * G, D]``: each KV head's rows, query-major."""
    d, m, hq, dim = q.shape
    return q.view(d, m, hkv, hq // hkv, dim).transpose(1, 2).reshape(d, hkv, -1, dim)


def _attend_shared(groups_q: torch.Tensor, layer: torch.Tensor, group: CascadeGroup,
                   block_size: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A cascade group's members' rows ``[n, Hkv, R, D]`` over their shared pages, in one kernel
    call: the output ``[n, Hkv, R, D]`` and log-sum-exp ``[n, Hkv, R, 1]``."""
    n, hkv, _, dim = groups_q.shape
    ks, vs = gather_kv(layer, group.shared_pages, group.num_pages * block_size, groups_q.dtype)
    gq = groups_q.transpose(0, 1).reshape(1, hkv, -1, dim)  # [1, Hkv, n*R, D]
    out, lse = _attend_with_lse(gq, ks.transpose(0, 1)[None], vs.transpose(0, 1)[None], None, scale)
    return out[0].view(hkv, n, -1, dim).transpose(0, 1), lse[0].view(hkv, n, -1, 1).transpose(0, 1)


def _shared_state(q: torch.Tensor, layer: torch.Tensor, plan: DecodePlan, block_size: int,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Every row's attention over its cascade group's shared pages, ``(out [d, Hkv, m * G, D],
    lse [d, Hkv, m * G, 1])`` (lse ``-inf`` in rows of sequences in no group), or ``None`` when the
    plan has no group."""
    if not plan.groups:
        return None
    d, hkv = q.shape[0], layer.shape[3]
    groups_q = _query_groups(q, hkv)
    if len(plan.groups) == 1 and plan.groups[0].members.shape[0] == d:  # one group of everyone
        return _attend_shared(groups_q, layer, plan.groups[0], block_size, scale)
    out = torch.zeros_like(groups_q)
    lse = torch.full((*groups_q.shape[:3], 1), float("-inf"), dtype=q.dtype, device=q.device)
    for group in plan.groups:
        out[group.members], lse[group.members] = _attend_shared(groups_q[group.members], layer, group,
                                                                block_size, scale)
    return out, lse


def _attend_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                     scale: float, causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``q [B, H, M, D]`` over ``k, v [B, H, L, D]`` with an additive ``bias``
    (``0`` / ``-inf``, broadcast to ``[B, H, M, L]``) or, with ``causal``, over a square (``M ==
    L``) causally: the output and the natural-log log-sum-exp ``[B, H, M, 1]`` (what merging two
    key sets needs). On the CPU one fused kernel does it, elsewhere matmuls in ``q``'s dtype."""
    if fused_cpu_kernel(q):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, is_causal=causal, attn_mask=bias, scale=scale)
        return out, lse[..., None]
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        scores.masked_fill_(torch.ones_like(scores[0, 0], dtype=torch.bool).triu(1), float("-inf"))
    if bias is not None:
        scores.add_(bias)  # in place: the float32 mask must not promote the scores
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.matmul(scores.sub_(lse).exp_(), v), lse


def fused_cpu_kernel(q: torch.Tensor) -> bool:
    """Whether ``_attend_with_lse`` runs torch's fused CPU attention kernel for ``q``."""
    return q.device.type == "cpu"


def merge_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                 lse_b: torch.Tensor) -> torch.Tensor:
    """Combine two attention results over disjoint key sets into the result over their union
    (log-sum-exps ``[..., M, 1]``)."""
    lse = torch.logaddexp(lse_a, lse_b)
    return out_a * torch.exp(lse_a - lse) + out_b * torch.exp(lse_b - lse)


def cross_attention(query: torch.Tensor, layer: torch.Tensor, cross: CrossBatch,
                    scale: float, check_bounds: bool = False) -> torch.Tensor:
    """Non-causal attention of packed queries ``[T, q_heads, head_dim]`` over their images' K/V
    pages; rows of sequences without images get zeros. When the plan allows it
    (``CrossBatch.one_call``), the native decode kernel attends all groups in one call where
    they lie; otherwise each group gathers its pages and runs SDPA with its mask. ``check_bounds``:
    as in ``attention``."""
    out = torch.zeros_like(query)
    batch = cross.one_call
    if batch is not None and native.supports(q := query.to(compute_dtype(query)), layer):
        d, m = batch.positions.shape
        q = q.index_select(0, batch.queries).view(d, m, *query.shape[1:])
        o = native.paged_decode(q, layer, batch.pages, batch.lens, batch.key_start, batch.positions,
                                scale, None, None, check_bounds).view(d * m, *query.shape[1:])
        o = o if batch.slots is None else o.index_select(0, batch.slots)
        return out.index_copy_(0, batch.rows, o.to(query.dtype))
    for group in cross.groups:
        k, v = gather_kv(layer, group.pages, group.kv_len, query.dtype)
        q = query[group.rows].transpose(0, 1)[None]  # [1, H, n, D]
        o = F.scaled_dot_product_attention(q, k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           attn_mask=group.allowed[None, None], scale=scale,
                                           enable_gqa=True)
        out[group.rows] = o[0].transpose(0, 1)
    return out


class TorchBackend(AttentionBackend):
    """Plain torch on any device and dtype: the reference implementation."""

    name = "torch"
    writes_slots_in_place = True

    def write_kv(self, step: StepContext, layer: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor) -> None:
        write_kv(layer, step.batch, key, value)

    def attention(self, step: StepContext, query: torch.Tensor, layer: torch.Tensor, scale: float,
                  sliding_window: int | None) -> torch.Tensor:
        return attention(query, layer, step.batch, scale, sliding_window, step.check_bounds)

    def cross_attention(self, step: StepContext, query: torch.Tensor, layer: torch.Tensor,
                        scale: float) -> torch.Tensor:
        return cross_attention(query, layer, step.cross, scale, step.check_bounds)

    def write_image_kv(self, layer: torch.Tensor, pages: list[int], start: int, key: torch.Tensor,
                       value: torch.Tensor) -> None:
        bs = layer.shape[2]
        pos = torch.arange(start, start + key.shape[0])
        blocks = torch.tensor(pages, dtype=torch.long)[pos // bs].to(layer.device)
        offsets = (pos % bs).to(layer.device)
        layer[blocks, 0, offsets] = kv_format.encode(key, layer.dtype)
        layer[blocks, 1, offsets] = kv_format.encode(value, layer.dtype)
