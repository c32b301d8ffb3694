"""The native decode-attention kernel against dense float64 attention, on the page sizes and head
sizes models use (the torch-path tests in test_torch_attention.py run it on tiny ones too)."""

import math

import pytest
import torch

from hypothesis import given, settings
from hypothesis import strategies as st

from cache import kv_format
from mmkv import native as native_library
from mmkv.attention import native

BS = 16


def forget_kernels() -> None:
    """Drop the loaded library and the kernel looked up in it: the next use builds or loads them
    under the environment and flags of the moment."""
    native_library.library.cache_clear()
    native.kernel.cache_clear()


def test_the_kernel_builds_on_this_machine():
    """The project's machines have a C compiler: a kernel that failed to build must not pass
    unnoticed as the torch path."""
    assert native.kernel() is not None


def test_a_cpu_engine_builds_the_kernel_before_its_first_request(monkeypatch):
    """The build (about a second on first use) belongs to start-up, not to a first request's latency."""
    from mmkv.attention.backend import choose_backend

    forget_kernels()
    try:
        choose_backend("torch", torch.device("cpu"), [(torch.float32, 64)])
        assert native.kernel.cache_info().currsize == 1
    finally:
        forget_kernels()


def test_without_the_kernel_the_torch_path_runs(monkeypatch):
    monkeypatch.setenv("MMKV_NATIVE", "0")
    forget_kernels()
    try:
        assert native.kernel() is None
        assert not native.supports(torch.zeros(1, 1, 1, 8), torch.zeros(2, 2, BS, 1, 8))
    finally:
        forget_kernels()


def reference(q, k, v, q_pos, k_pos, scale, window, prior=None):
    """Dense attention in float64 of rows ``q [m, Hq, D]`` at ``q_pos`` over keys ``[L, Hkv, D]``
    at ``k_pos``, with ``prior`` keys ``(k, v)`` every row sees; the output and log-sum-exp."""
    group = q.shape[1] // k.shape[1]
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window:
        allowed &= k_pos[None, :] > q_pos[:, None] - window
    if prior is not None:
        allowed = torch.cat([torch.ones(len(q_pos), prior[0].shape[0], dtype=torch.bool), allowed], 1)
        k, v = torch.cat([prior[0], k]), torch.cat([prior[1], v])
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v), scores.logsumexp(-1)


@st.composite
def problems(draw):
    dim = draw(st.sampled_from([64, 128, 80, 24, 36]))  # 64-, 16- and 8-wide blocks, and a rest
    hkv = draw(st.sampled_from([1, 2, 4]))
    return dict(dim=dim, hkv=hkv, hq=hkv * draw(st.sampled_from([1, 2, 4])),
                m=draw(st.integers(1, 6)), lens=draw(st.lists(st.integers(1, 70), min_size=1, max_size=5)),
                offsets=draw(st.lists(st.integers(0, 40), min_size=5, max_size=5)),
                window=draw(st.sampled_from([None, None, 7, 20])), prior=draw(st.integers(0, 33)),
                dtype=draw(st.sampled_from(CACHE_DTYPES)), seed=draw(st.integers(0, 99)))


CACHE_DTYPES = [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn]


@settings(max_examples=60, deadline=None)
@given(problems())
def test_paged_decode_matches_dense_attention(p):
    """Sequences of any length (a partial last page, padding in the page table), queries at their
    last positions (causal among themselves), a window, a prior state merged in (what a
    cascade's shared pages give), every cache format (compressed pages against their decoded
    values)."""
    check_against_dense(p)


def check_against_dense(p: dict) -> None:
    """The kernel's output on problem ``p`` (as ``problems`` draws them) against ``reference``."""
    g = torch.Generator().manual_seed(p["seed"])
    dim, hq, hkv, m, lens = p["dim"], p["hq"], p["hkv"], p["m"], p["lens"]
    d, width = len(lens), max(-(-n // BS) for n in lens)
    layer = kv_format.encode(torch.randn(d * width + 3, 2, BS, hkv, dim, generator=g), p["dtype"])
    order = torch.randperm(d * width + 3, generator=g).tolist()  # pages scattered in the pool
    pages = torch.tensor([order[i * width:(i + 1) * width] for i in range(d)])
    key_start = torch.tensor([p["offsets"][i] for i in range(d)])
    # each sequence's m queries at its last positions (repeating the last where it has fewer keys)
    positions = torch.stack([key_start[i] + torch.arange(lens[i] - m, lens[i]).clamp(min=0)
                             for i in range(d)])
    q = torch.randn(d, m, hq, dim, generator=g)
    scale = 1 / math.sqrt(dim)
    state, priors = None, [None] * d
    if p["prior"]:
        priors = [(torch.randn(p["prior"], hkv, dim, generator=g), torch.randn(p["prior"], hkv, dim, generator=g))
                  for _ in range(d)]
        outs, lses = zip(*(reference(q[i], prior[0][:0], prior[1][:0], positions[i],
                                     torch.zeros(0, dtype=torch.long), scale, None, prior)
                           for i, prior in enumerate(priors)))
        # the kernel's layout: [d, Hkv, m * G, D] rows query-major within a KV head
        group = hq // hkv
        state = (torch.stack(outs).float().view(d, m, hkv, group, dim).transpose(1, 2).reshape(d, hkv, -1, dim),
                 torch.stack(lses).float().view(d, hkv, group, m).transpose(2, 3).reshape(d, hkv, -1, 1))
    out = native.paged_decode(q, layer, pages, torch.tensor(lens), key_start, positions, scale,
                              p["window"], state)
    for i in range(d):
        flat = kv_format.decode(layer[pages[i]])  # [width, 2, BS, Hkv, D]
        k = flat[:, 0].reshape(-1, hkv, dim)[:lens[i]]
        v = flat[:, 1].reshape(-1, hkv, dim)[:lens[i]]
        want, _ = reference(q[i], k, v, positions[i], key_start[i] + torch.arange(lens[i]), scale,
                            p["window"], priors[i])
        atol = 2e-5 + (query_rounding_bound(q[i], k, v, scale) if p["dtype"] == torch.int8 else 0.0)
        torch.testing.assert_close(out[i].double(), want, atol=atol, rtol=2e-5)


def query_rounding_bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> float:
    """How far rounding the queries to 16 bits (what the kernel does to attend int8 keys as
    integers) may move an output: each score by at most ``delta = scale * step / 2 * max_t
    |k_t|_1`` (``step`` the largest query step), so each softmax weight by a factor within
    ``exp(+-2 delta)`` and the output by at most ``(exp(2 delta) - 1) * max |v|``."""
    dim = q.shape[-1]
    limit = min(32767, (2 ** 31 - 1) // (127 * dim))
    step = float(q.abs().amax()) / limit
    delta = scale * step / 2 * float(k.abs().sum(-1).amax()) if len(k) else 0.0
    return math.expm1(2 * delta) * float(v.abs().amax() if len(v) else 0.0)


def test_the_portable_build_matches(tmp_path, monkeypatch):
    """Built without AVX-512 (other CPUs), the kernel's plain C loops give the same results."""
    monkeypatch.setattr(native_library, "FLAGS", native_library.FLAGS + ("-mno-avx512f",))
    monkeypatch.setenv("MMKV_NATIVE_CACHE", str(tmp_path))
    forget_kernels()
    try:
        assert native.kernel() is not None and list(tmp_path.glob("*.so"))
        for seed in range(4):
            check_against_dense(dict(
                dim=(64, 80)[seed % 2], hkv=2, hq=4, m=1 + seed, lens=[5, 40, 17], offsets=[0, 3, 30, 0, 0],
                window=(None, 9)[seed // 2], prior=3 * seed, dtype=CACHE_DTYPES[seed], seed=seed))
    finally:
        forget_kernels()
