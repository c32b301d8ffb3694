"""FlashInfer 0.7.4's paged attention in plain torch: the semantics its kernels implement, for CPU.

The module has the API mmkv's FlashInfer backend calls (two wrappers, ``append_paged_kv_cache``,
``merge_state``), so the backend can run on it on a CPU. Each call is first bound against the
signatures recorded from the real package (``flashinfer_api``) and checked against what the real
package requires or silently gets wrong (FlashInfer 0.7.4's documented API): int32 index arrays, the
page-table shape, dtypes said at ``plan()`` and met at ``run()``, options by keyword, K/V in the
cache's dtype, the post-append page table, contiguous float32 log-sum-exp. Then, in float64:

* request ``b``'s KV is ``kv_len = (pages - 1) * page_size + last_page_len`` tokens, gathered from
  ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]``; its queries are ``q[qo_indptr[b]:qo_indptr[b + 1]]``;
  query head ``h`` reads KV head ``h // (q_heads // kv_heads)``;
* causal masks are bottom-right aligned: query row ``i`` sees keys ``j <= i + kv_len - qo_len``
  (and ``j >= i + kv_len - qo_len - window_left`` with a window); a custom mask is
  ``[qo_len, kv_len]`` row-major per request, concatenated;
* the log-sum-exp is base 2; a row that sees no key gets output 0 and log-sum-exp ``-inf``;
* ``merge_state`` combines two states by their base-2 log-sum-exp.

The real kernels reject float32; this reference computes in it too, so the engine can be checked
token for token against transformers' float32 ``generate`` (the dtype rule is tested on its own).
"""

from __future__ import annotations

import math

import torch

from flashinfer_api import bind

LN2 = math.log(2.0)
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _dtype(d) -> torch.dtype:
    return DTYPES[d] if isinstance(d, str) else d


def _check_index(name: str, t: torch.Tensor, host: bool) -> None:
    assert isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.dim() == 1, \
        f"{name} must be a 1-D int32 tensor, got {getattr(t, 'dtype', type(t))}"
    if host:
        assert t.device.type == "cpu", f"{name} should be planned from the host, got {t.device}"


def _check_table(kv_indptr, kv_indices, last, page_size, host=True) -> list[int]:
    """Page-table checks; the KV length of every request."""
    for name, t in (("kv_indptr", kv_indptr), ("kv_indices", kv_indices), ("kv_last_page_len", last)):
        _check_index(name, t, host)
    ptr = kv_indptr.tolist()
    assert ptr[0] == 0 and len(ptr) == last.shape[0] + 1 and ptr[-1] == kv_indices.shape[0], \
        "kv_indptr must start at 0, have one entry per request plus one and end at len(kv_indices)"
    lens = []
    for b, n in enumerate(last.tolist()):
        pages = ptr[b + 1] - ptr[b]
        assert (pages == 0 and n == 0) or (pages > 0 and 1 <= n <= page_size), \
            f"request {b}: last_page_len {n} with {pages} pages of {page_size}"
        lens.append(max(pages - 1, 0) * page_size + n)
    return lens


def gather(cache: torch.Tensor, kv_indptr, kv_indices, b: int, kv_len: int):
    """K and V ``[kv_len, kv_heads, head_dim]`` of request ``b``."""
    pages = kv_indices[kv_indptr[b]:kv_indptr[b + 1]].long()
    _, _, page, h, d = cache.shape
    return (cache[pages, 0].reshape(-1, h, d)[:kv_len], cache[pages, 1].reshape(-1, h, d)[:kv_len])


def attend(q, k, v, allowed, scale):
    """``q [n, Hq, D]`` over ``k, v [L, Hk, D]`` where ``allowed [n, L]``: output (q's dtype) and
    base-2 log-sum-exp ``[n, Hq]`` (float32), in float64."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->qhk", q.double(), k) * scale
    scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, -1)  # -inf where nothing is allowed
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("qhk,khd->qhd", probs, v)
    return out.to(q.dtype).contiguous(), (lse / LN2).float().contiguous()


def causal_allowed(qo_len: int, kv_len: int, window_left: int = -1) -> torch.Tensor:
    """Bottom-right aligned: row ``i`` sees keys up to ``i + kv_len - qo_len``."""
    last = torch.arange(qo_len)[:, None] + kv_len - qo_len
    j = torch.arange(kv_len)[None, :]
    allowed = j <= last
    if window_left >= 0:
        allowed &= j >= last - window_left
    return allowed


def batch_attention(q, cache, qo_indptr, kv_indptr, kv_indices, last, causal, scale,
                    window_left=-1, custom_mask=None):
    """What a planned prefill wrapper's ``run(q, cache, return_lse=True)`` returns."""
    qo = qo_indptr.tolist()
    kv_lens = _check_table(kv_indptr, kv_indices, last, cache.shape[2], host=False)
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:2], float("-inf"))
    mask_at = 0
    for b, kv_len in enumerate(kv_lens):
        n = qo[b + 1] - qo[b]
        if custom_mask is not None:
            allowed = custom_mask[mask_at:mask_at + n * kv_len].view(n, kv_len)
            mask_at += n * kv_len
        elif causal:
            allowed = causal_allowed(n, kv_len, window_left)
        else:
            assert window_left < 0, "mmkv plans no window without a causal mask"
            allowed = torch.ones(n, kv_len, dtype=torch.bool)
        k, v = gather(cache, kv_indptr, kv_indices, b, kv_len)
        out[qo[b]:qo[b + 1]], lse[qo[b]:qo[b + 1]] = attend(q[qo[b]:qo[b + 1]], k, v, allowed, scale)
    return out, lse


class _Wrapper:
    name = ""

    def __init__(self, *args, **kwargs):
        bound = bind(f"{self.name}.__init__", args, kwargs).arguments
        workspace = bound["float_workspace_buffer"]
        assert workspace.dtype == torch.uint8, "the float workspace is a uint8 buffer"
        assert bound.get("kv_layout", "NHD") == "NHD", "mmkv's pool is NHD (the name is case-sensitive)"
        self.plan_args: dict | None = None

    def _plan(self, qo_indptr, kv_indptr, kv_indices, last, heads, options):
        q_heads, kv_heads, head_dim, page_size = heads
        assert "q_data_type" in options and "kv_data_type" in options, \
            "pass q_data_type and kv_data_type (q_data_type defaults to float16)"
        assert q_heads % kv_heads == 0, "query heads must be a multiple of KV heads"
        _check_index("qo_indptr", qo_indptr, host=True)
        kv_lens = _check_table(kv_indptr, kv_indices, last, page_size)
        assert qo_indptr.shape == kv_indptr.shape and qo_indptr[0] == 0
        mask = options.get("custom_mask")
        if mask is not None:
            qo = qo_indptr.tolist()
            size = sum((qo[b + 1] - qo[b]) * n for b, n in enumerate(kv_lens))
            assert mask.dtype == torch.bool and mask.shape == (size,), \
                f"custom_mask must be bool [{size}] (qo_len x kv_len per request), got {mask.shape}"
        self.plan_args = dict(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices,
                              last=last, heads=heads, scale=options.get("sm_scale") or head_dim ** -0.5,
                              causal=options.get("causal", False), window_left=options.get("window_left", -1),
                              custom_mask=mask, q_dtype=_dtype(options["q_data_type"]),
                              kv_dtype=_dtype(options["kv_data_type"]))

    def run(self, *args, **kwargs):
        bound = bind(f"{self.name}.run", args, kwargs).arguments
        assert not bound.get("args"), "run() takes q and the cache only; options belong to plan()"
        p = self.plan_args
        assert p is not None, "run() before plan()"
        q, cache = bound["q"], bound["paged_kv_cache"]
        q_heads, kv_heads, head_dim, page_size = p["heads"]
        assert q.dtype == p["q_dtype"], f"q is {q.dtype} but the plan said {p['q_dtype']}"
        assert cache.dtype == p["kv_dtype"], f"the cache is {cache.dtype} but the plan said {p['kv_dtype']}"
        assert q.shape == (int(p["qo_indptr"][-1]), q_heads, head_dim), f"q has shape {tuple(q.shape)}"
        assert cache.dim() == 5 and cache.shape[1:] == (2, page_size, kv_heads, head_dim), \
            f"the cache must be [pages, 2, {page_size}, {kv_heads}, {head_dim}] (NHD)"
        out, lse = batch_attention(q, cache, p["qo_indptr"], p["kv_indptr"], p["kv_indices"], p["last"],
                                   p["causal"], p["scale"], p["window_left"], p["custom_mask"])
        return (out, lse) if bound.get("return_lse") else out


class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
    name = "BatchPrefillWithPagedKVCacheWrapper"

    def plan(self, *args, **kwargs):
        a = bind(f"{self.name}.plan", args, kwargs).arguments
        heads = (a["num_qo_heads"], a["num_kv_heads"], a["head_dim_qk"], a["page_size"])
        self._plan(a["qo_indptr"], a["paged_kv_indptr"], a["paged_kv_indices"],
                   a["paged_kv_last_page_len"], heads, kwargs)


class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
    name = "BatchDecodeWithPagedKVCacheWrapper"

    def plan(self, *args, **kwargs):
        assert len(args) == 7, "options go to the decode plan() by keyword (positional is deprecated)"
        a = bind(f"{self.name}.plan", args, kwargs).arguments
        heads = (a["num_qo_heads"], a["num_kv_heads"], a["head_dim"], a["page_size"])
        qo = torch.arange(a["last_page_len"].shape[0] + 1, dtype=torch.int32)
        # one query per request: a bottom-right causal mask hides nothing but the window's keys
        self._plan(qo, a["indptr"], a["indices"], a["last_page_len"], heads,
                   {**kwargs, "causal": True})


def append_paged_kv_cache(*args, **kwargs) -> None:
    a = bind("append_paged_kv_cache", args, kwargs).arguments
    key, value, cache = a["append_key"], a["append_value"], a["paged_kv_cache"]
    assert a.get("kv_layout", "NHD") == "NHD"
    for name in ("batch_indices", "positions"):
        _check_index(name, a[name], host=False)
    kv_lens = _check_table(a["kv_indptr"], a["kv_indices"], a["kv_last_page_len"], cache.shape[2],
                           host=False)
    assert key.dtype == value.dtype == cache.dtype, \
        f"K/V are {key.dtype} but the cache is {cache.dtype} (FlashInfer would reinterpret the bytes)"
    assert key.shape == value.shape == (a["positions"].shape[0], *cache.shape[3:])
    ptr, indices, page = a["kv_indptr"].tolist(), a["kv_indices"].tolist(), cache.shape[2]
    for t, (b, pos) in enumerate(zip(a["batch_indices"].tolist(), a["positions"].tolist())):
        assert 0 <= pos < kv_lens[b], \
            f"position {pos} of request {b} lies past its {kv_lens[b]} tokens: pass the post-append table"
        slot = indices[ptr[b] + pos // page]
        cache[slot, 0, pos % page] = key[t]
        cache[slot, 1, pos % page] = value[t]


def merge_state(*args, **kwargs):
    a = bind("merge_state", args, kwargs).arguments
    v_a, s_a, v_b, s_b = a["v_a"], a["s_a"], a["v_b"], a["s_b"]
    for t in (v_a, s_a, v_b, s_b):
        assert t.is_contiguous(), "merge_state takes contiguous tensors"
    assert v_a.shape == v_b.shape and s_a.shape == s_b.shape == v_a.shape[:2]
    assert s_a.dtype == s_b.dtype == torch.float32, "log-sum-exp values are float32"
    s_a, s_b = s_a.double(), s_b.double()
    m = torch.maximum(s_a, s_b)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w_a, w_b = torch.exp2(s_a - m), torch.exp2(s_b - m)
    total = w_a + w_b
    v = (w_a[..., None] * v_a.double() + w_b[..., None] * v_b.double()) / total.clamp_min(1e-300)[..., None]
    return v.to(v_a.dtype), (m + torch.log2(total)).float()
