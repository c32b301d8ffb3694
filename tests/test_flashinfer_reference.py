"""The pure-torch reference of FlashInfer's semantics, and the torch backend and metadata against it.

The reference (``flashinfer_reference``) is checked against dense attention written out directly;
then the torch backend, fed the same ``PagedBatch``, must give what FlashInfer's kernels would
given that batch's ``qo_indptr``/``kv_indptr``/``kv_indices``/``kv_last_page_len``, and the
cascade split (shared pages, not causal, merged with each sequence's own pages, causal) must equal
full causal attention.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashinfer_reference as ref
from mmkv.attention import flashinfer_backend as fb
from mmkv.attention.metadata import plan_batch
from mmkv.attention.torch_backend import attention, write_kv
from test_torch_attention import BS, D, HKV, HQ, build, dense_reference

CPU = torch.device("cpu")
SCALE = D ** -0.5


def i32(x):
    return torch.tensor(x, dtype=torch.int32)


def test_paged_gather_follows_the_page_table():
    cache = torch.arange(6 * 2 * BS * HKV * D, dtype=torch.float32).view(6, 2, BS, HKV, D)
    k, v = ref.gather(cache, [0, 2, 5], i32([4, 1, 3, 0, 5]), 1, 2 * BS + 3)
    want = torch.cat([cache[3, 0], cache[0, 0], cache[5, 0]])[:2 * BS + 3]
    assert torch.equal(k, want) and torch.equal(v, torch.cat([cache[3, 1], cache[0, 1], cache[5, 1]])[:11])


def test_causal_mask_is_bottom_right_aligned():
    allowed = ref.causal_allowed(2, 5)  # two queries, the last two of five positions
    assert allowed.tolist() == [[True, True, True, True, False], [True] * 5]
    assert ref.causal_allowed(3, 6, window_left=1).tolist() == [
        [False, False, True, True, False, False], [False, False, False, True, True, False],
        [False, False, False, False, True, True]]


def test_lse_is_base_2_and_an_empty_row_gives_zero_and_minus_infinity():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 2, D, generator=g) for n in (2, 5, 5))
    allowed = torch.tensor([[True] * 5, [False] * 5])
    out, lse = ref.attend(q, k, v, allowed, SCALE)
    scores = torch.einsum("hd,khd->hk", q[0].double(), k.double()) * SCALE
    assert torch.allclose(lse[0].double(), torch.log2(torch.exp(scores).sum(-1)), atol=1e-6)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isinf(lse[1]).all()


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 30), st.integers(1, 30))
def test_merge_state_of_two_key_sets_is_attention_over_their_union(n_a, n_b):
    g = torch.Generator().manual_seed(n_a * 31 + n_b)
    q = torch.randn(3, HQ, D, generator=g)
    k, v = torch.randn(n_a + n_b, HKV, D, generator=g), torch.randn(n_a + n_b, HKV, D, generator=g)
    every = torch.ones(3, n_a + n_b, dtype=torch.bool)
    whole, whole_lse = ref.attend(q, k, v, every, SCALE)
    a = ref.attend(q, k[:n_a], v[:n_a], every[:, :n_a], SCALE)
    b = ref.attend(q, k[n_a:], v[n_a:], every[:, n_a:], SCALE)
    merged, lse = ref.merge_state(*a, *b)
    torch.testing.assert_close(merged, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, whole_lse, atol=1e-5, rtol=1e-5)
    nothing = ref.attend(q, k[:1], v[:1], torch.zeros(3, 1, dtype=torch.bool), SCALE)
    assert torch.equal(ref.merge_state(*a, *nothing)[0], a[0])  # an empty state changes nothing


@st.composite
def batches(draw):
    """Sequences (kv_len, new tokens, parent, shared tokens) like test_torch_attention's: some
    share leading pages, new tokens from 1 (decode) to whole prompts."""
    seqs = []
    for i in range(draw(st.integers(1, 6))):
        n = draw(st.integers(1, 40))
        qn = draw(st.sampled_from([1, 1, 2, 5, n]))
        parent = draw(st.none() | st.integers(0, i - 1)) if i else None
        shared = 0
        if parent is not None:
            shared = min(draw(st.integers(0, 40)), seqs[parent][0], n - 1) // BS * BS
        seqs.append((n, min(qn, n), parent if shared else None, shared))
    return seqs, draw(st.booleans()), draw(st.none() | st.integers(3, 30))


def _filled(seqs, cascade):
    layer, tables, kvs, g = build(seqs, num_pages=128)
    for table, (n, _, _, _), (k, v) in zip(tables, seqs, kvs):
        for pos in range(n):
            layer[table[pos // BS], 0, pos % BS] = k[pos]
            layer[table[pos // BS], 1, pos % BS] = v[pos]
    q_lens = [qn for _, qn, _, _ in seqs]
    batch = plan_batch(tables, q_lens, [n for n, _, _, _ in seqs], BS, CPU, cascade=cascade)
    return layer, batch, kvs, torch.randn(sum(q_lens), HQ, D, generator=g)


@settings(max_examples=60, deadline=None)
@given(batches())
def test_torch_backend_gives_what_flashinfer_gives_for_the_same_metadata(case):
    """FlashInfer's causal prefill over the batch's own arrays (plus its window as window_left)
    against the torch backend reading the same PagedBatch, and both against dense attention."""
    seqs, cascade, window = case
    if cascade and window is not None and max(n for n, *_ in seqs) > window:
        window = None  # the engine plans no cascade under a window that cuts in
    layer, batch, kvs, query = _filled(seqs, cascade)
    h = batch.host
    want, _ = ref.batch_attention(query, layer, h.qo_indptr, h.kv_indptr, h.kv_indices,
                                  h.kv_last_page_len, True, SCALE, fb._window_left(window, batch.kv_lens))
    got = attention(query, layer, batch, SCALE, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    start = 0
    for (n, qn, _, _), (k, v) in zip(seqs, kvs):
        dense = dense_reference(query[start:start + qn], k, v, n, SCALE, window)
        torch.testing.assert_close(want[start:start + qn], dense, atol=1e-5, rtol=1e-5)
        start += qn


@settings(max_examples=60, deadline=None)
@given(batches())
def test_cascade_split_equals_full_causal_attention(case):
    """The backend's cascade plan, run by the reference: each group's shared pages (not causal,
    one request per group) merged with every sequence's own pages (causal) equals causal
    attention over the whole sequence."""
    seqs, _, _ = case
    layer, batch, _, query = _filled(seqs, cascade=True)
    plan = fb.plan_self_attention(batch, fb.Heads.of(query, layer, SCALE))
    h = batch.host
    want, _ = ref.batch_attention(query, layer, h.qo_indptr, h.kv_indptr, h.kv_indices,
                                  h.kv_last_page_len, True, SCALE)
    wrapper = getattr(ref, plan.main.target.split(".")[0])(torch.zeros(1, dtype=torch.uint8), "NHD")
    wrapper.plan(*plan.main.args, **plan.main.kwargs)
    out, lse = wrapper.run(query, layer, return_lse=True)
    if plan.shared is not None:
        shared = ref.BatchPrefillWithPagedKVCacheWrapper(torch.zeros(1, dtype=torch.uint8), "NHD")
        shared.plan(*plan.shared.args, **plan.shared.kwargs)
        rows = plan.shared_rows if plan.shared_rows is not None else torch.arange(query.shape[0])
        s_out, s_lse = shared.run(query[rows], layer, return_lse=True)
        out[rows] = ref.merge_state(out[rows], lse[rows], s_out, s_lse)[0]
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_cascade_runs_on_fewer_keys_when_groups_share_pages():
    """The split moves the shared pages out of every member's own table into one per group."""
    seqs = [(21, 1, None, 0), (23, 1, 0, 20), (22, 1, 0, 20)]
    layer, batch, _, query = _filled(seqs, cascade=True)
    plan = fb.plan_self_attention(batch, fb.Heads.of(query, layer, SCALE))
    assert plan.pattern == "decode"  # plan(kv_indptr, kv_indices, last_page_len, ...)
    assert plan.main.args[0].tolist() == [0, 1, 2, 3] and plan.main.args[1].tolist() == [5, 6, 7]
    assert plan.shared.args[1].tolist() == [0, 5]  # the 5 shared pages, once
    assert plan.shared_rows is None  # every row is in the group: no gather


def test_append_positions_come_from_the_post_append_lengths():
    """``append_paged_kv_cache`` with the step's index writes every new token where the torch
    backend's ``write_kv`` does; with the page table before the append it refuses."""
    seqs = [(14, 13, None, 0), (21, 1, None, 0), (22, 6, 1, 16), (9, 4, None, 0)]
    layer, tables, kvs, g = build(seqs)
    q_lens = [qn for _, qn, _, _ in seqs]
    batch = plan_batch(tables, q_lens, [n for n, *_ in seqs], BS, CPU)
    key, value = torch.randn(sum(q_lens), HKV, D, generator=g), torch.randn(sum(q_lens), HKV, D, generator=g)
    want, got = layer.clone(), layer.clone()
    write_kv(want, batch, key, value)
    index = fb.append_index(batch)
    ref.append_paged_kv_cache(key, value, *index[:2], got, *index[2:])
    assert torch.equal(got, want)
    assert index.positions.tolist() == [p for n, qn, *_ in seqs for p in range(n - qn, n)]
    old = [n - qn for n, qn, *_ in seqs]  # the page table before this step's tokens
    pages = [t[:-(-n // BS)] for t, n in zip(tables, old)]
    indptr = [0]
    for pg in pages:
        indptr.append(indptr[-1] + len(pg))
    with pytest.raises(AssertionError, match="post-append"):
        ref.append_paged_kv_cache(key, value, *index[:2], got, i32(sum(pages, [])), i32(indptr),
                                  i32([(n - 1) % BS + 1 for n in old]))


def test_reference_refuses_what_flashinfer_gets_wrong():
    """int64 indices, q in another dtype than planned, K/V in another dtype than the cache."""
    cache = torch.zeros(4, 2, BS, HKV, D, dtype=torch.bfloat16)
    wrapper = ref.BatchPrefillWithPagedKVCacheWrapper(torch.zeros(1, dtype=torch.uint8), "NHD")
    args = [i32([0, 1]), i32([0, 1]), i32([2]), i32([1]), HQ, HKV, D, BS]
    with pytest.raises(AssertionError, match="int32"):
        wrapper.plan(torch.tensor([0, 1]), *args[1:], causal=True, q_data_type=torch.bfloat16,
                     kv_data_type=torch.bfloat16)
    with pytest.raises(AssertionError, match="q_data_type"):
        wrapper.plan(*args, causal=True)
    wrapper.plan(*args, causal=True, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    with pytest.raises(AssertionError, match="the plan said"):
        wrapper.run(torch.zeros(1, HQ, D), cache)
    with pytest.raises(AssertionError, match="reinterpret"):
        ref.append_paged_kv_cache(torch.zeros(1, HKV, D), torch.zeros(1, HKV, D), i32([0]), i32([0]),
                                  cache, i32([2]), i32([0, 1]), i32([1]))
