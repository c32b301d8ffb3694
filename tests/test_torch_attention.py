"""Paged torch attention against dense attention over contiguous K/V (float64 reference)."""

import pytest
import torch

from hypothesis import given, settings
from hypothesis import strategies as st

from mmkv.attention.metadata import (SHORT_QUERY, CrossSequence, OneCallLimits, next_position, plan_batch,
                                     plan_cross)
from mmkv.attention import metadata, native, torch_backend
from mmkv.attention.torch_backend import SPLIT_QUERIES, attention, write_kv

BS, HQ, HKV, D = 4, 4, 2, 8


@pytest.fixture(autouse=True, params=["native", "torch"])
def decode_path(request, monkeypatch):
    """Every test here runs twice: batched decode attention by the native kernel (where it
    applies) and by torch alone."""
    if request.param == "torch":
        monkeypatch.setattr(native, "supports", lambda query, layer: False)
    return request.param


def dense_reference(q, k, v, kv_len, scale, window=None):
    """q [n, HQ, D] are the last n positions of a kv_len-token sequence."""
    n = q.shape[0]
    k = k.double().repeat_interleave(HQ // HKV, dim=1)
    v = v.double().repeat_interleave(HQ // HKV, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos = torch.arange(kv_len - n, kv_len)[:, None]
    k_pos = torch.arange(kv_len)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).float()


def build(seqs, num_pages=64, seed=0, dtype=torch.float32):
    """seqs: list of (kv_len, q_len, shared_with_index_or_None, shared_tokens)."""
    g = torch.Generator().manual_seed(seed)
    layer = torch.zeros(num_pages, 2, BS, HKV, D, dtype=dtype)
    free = list(range(num_pages))
    tables, kvs = [], []
    for kv_len, q_len, parent, shared in seqs:
        k = torch.randn(kv_len, HKV, D, generator=g)
        v = torch.randn(kv_len, HKV, D, generator=g)
        table = []
        if parent is not None:
            table = tables[parent][: shared // BS]
            k[:shared], v[:shared] = kvs[parent][0][:shared], kvs[parent][1][:shared]
        while len(table) * BS < kv_len:
            table.append(free.pop(0))
        tables.append(table)
        kvs.append((k, v))
    return layer, tables, kvs, g


# A batch of every kind of row: (kv_len, q_len, shared_with_index_or_None, shared_tokens).
MIXED = [(13, 13, None, 0),  # a short prompt (batched in the bucket of 9-16 new tokens)
         (90, 70, None, 0),  # a long prompt (more than SHORT_QUERY new tokens: attended alone)
         (19, 1, None, 0),  # decode, parent of a group
         (21, 1, 2, 16),  # decode sharing 4 full pages with seq 2
         (17, 1, 2, 16),  # decode sharing 4 pages; its last page is new
         (22, 6, 2, 16),  # a speculative verification over a shared prefix (bucket 5-8)
         (19, 5, 2, 16),  # one whose new tokens start inside the pages it shares
         (9, 1, None, 0)]  # decode alone


# The runner plans cascade only when no sliding window cuts into a sequence.
@pytest.mark.parametrize("cascade, window", [(True, None), (False, None), (False, 5)])
def test_mixed_batch_matches_dense(cascade, window):
    batch = assert_matches_dense(MIXED, cascade, window)
    # buckets of 1, 5-8 and 9-16 new tokens; without cascade the decodes' own pages (3 and 5-6)
    # fall in two width classes, so their bucket splits
    assert batch.prefill == [1] and len(batch.decode) == (3 if cascade else 4)
    assert len(batch.cascade_groups) == (2 if cascade else 0)  # one per bucket: decodes, verifications


@pytest.mark.parametrize("cascade, window", [(True, None), (False, None), (False, 5)])
def test_gpu_arithmetic_in_bfloat16_matches_dense(cascade, window, monkeypatch):
    """What a CUDA device runs, here on the CPU: attention in the query's dtype (bfloat16) by
    matmuls, the float32 masks of padded rows added without promoting the scores (the native
    kernel takes float32 queries only, so both decode paths run this)."""
    monkeypatch.setattr(torch_backend, "compute_dtype", lambda query: query.dtype)
    monkeypatch.setattr(torch_backend, "fused_cpu_kernel", lambda q: False)
    assert_matches_dense(MIXED, cascade, window, dtype=torch.bfloat16)


@pytest.mark.parametrize("q_lens, in_order", [([1, 1, 1], [True]), ([4, 4], [True]), ([3, 4], [False]),
                                              ([1, 1, 6], [True, False]), ([6, 1], [False, True])])
def test_short_query_batches_in_order_are_attended_in_place(q_lens, in_order):
    """A batch that is one plan of equal query lengths, its rows in order (decoding, a draft pass,
    equal drafts verified), is attended on views of the packed rows; any other is gathered and
    scattered by rows. Both give dense attention."""
    batch = assert_matches_dense([(9 + i, q, None, 0) for i, q in enumerate(q_lens)], False, None)
    assert [plan.in_order for plan in batch.decode] == in_order


def assert_matches_dense(seqs, cascade, window, dtype=torch.float32):
    """Plan ``seqs`` (see ``build``), write their new K/V, attend (in ``dtype``), and compare every
    row with the dense reference; returns the plan."""
    layer, tables, kvs, g = build(seqs, dtype=dtype)
    q_lens = [q for _, q, _, _ in seqs]
    kv_lens = [n for n, _, _, _ in seqs]
    batch = plan_batch(tables, q_lens, kv_lens, BS, torch.device("cpu"), cascade=cascade)
    # Old tokens already sit in the pages; new ones arrive through write_kv like in a forward step.
    for table, (n, q, _, _), (k, v) in zip(tables, seqs, kvs):
        for pos in range(n - q):
            layer[table[pos // BS], 0, pos % BS] = k[pos]
            layer[table[pos // BS], 1, pos % BS] = v[pos]
    new_k = torch.cat([k[n - q:] for (n, q, _, _), (k, _) in zip(seqs, kvs)])
    new_v = torch.cat([v[n - q:] for (n, q, _, _), (_, v) in zip(seqs, kvs)])
    write_kv(layer, batch, new_k, new_v)
    query = torch.randn(sum(q_lens), HQ, D, generator=g).to(dtype)
    out = attention(query, layer, batch, scale=D ** -0.5, sliding_window=window)
    assert out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 3e-2  # bfloat16: 8 bits of mantissa, unit-scale values
    start = 0
    for (n, q, _, _), (k, v) in zip(seqs, kvs):
        want = dense_reference(query[start:start + q], k.to(dtype), v.to(dtype), n, D ** -0.5, window)
        torch.testing.assert_close(out[start:start + q].float(), want, atol=tol, rtol=tol)
        start += q
    return batch


@pytest.mark.parametrize("query_chunk", [2048, 96])
def test_long_prompt_chunk_after_cached_tokens_matches_dense(query_chunk, monkeypatch):
    """A prompt chunk of ``SPLIT_QUERIES`` or more new tokens after earlier ones: the keys before
    each query chunk are attended unmasked and its own square causally, merged by log-sum-exp."""
    monkeypatch.setattr(torch_backend, "QUERY_CHUNK", query_chunk)
    kv_len, q_len = 2 * SPLIT_QUERIES + 37, SPLIT_QUERIES + 11
    layer, tables, kvs, g = build([(kv_len, q_len, None, 0)], num_pages=kv_len // BS + 1)
    (k, v), table = kvs[0], tables[0]
    for pos in range(kv_len):
        layer[table[pos // BS], 0, pos % BS] = k[pos]
        layer[table[pos // BS], 1, pos % BS] = v[pos]
    batch = plan_batch(tables, [q_len], [kv_len], BS, torch.device("cpu"))
    assert batch.prefill == [0]
    query = torch.randn(q_len, HQ, D, generator=g)
    out = attention(query, layer, batch, scale=D ** -0.5)
    want = dense_reference(query, k, v, kv_len, D ** -0.5)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kept", [torch_backend.KEPT_MASK_ELEMENTS, 0])
def test_a_prompt_chunks_mask_is_built_once_a_step_for_every_layer(kept, monkeypatch):
    """Two prompt chunks after cached tokens (fewer than ``SPLIT_QUERIES`` new ones each) are
    attended with causal masks that are the same in every layer: each is built at the step's
    first layer and kept for the others, unless it is larger than ``KEPT_MASK_ELEMENTS``. Every
    layer matches dense attention either way."""
    monkeypatch.setattr(torch_backend, "KEPT_MASK_ELEMENTS", kept)
    built, causal = [], torch_backend._causal_mask
    monkeypatch.setattr(torch_backend, "_causal_mask",
                        lambda *args: built.append(args[1]) or causal(*args))  # records kv_len
    seqs, layers = [(120, 100, None, 0), (100, 80, None, 0)], 3
    batch = None
    for seed in range(layers):  # each layer its own keys, values and queries; one plan
        layer, tables, kvs, g = build(seqs, seed=seed)
        batch = batch or plan_batch(tables, [100, 80], [120, 100], BS, torch.device("cpu"))
        assert batch.prefill == [0, 1]
        for table, (n, _, _, _), (k, v) in zip(tables, seqs, kvs):
            for pos in range(n):
                layer[table[pos // BS], 0, pos % BS], layer[table[pos // BS], 1, pos % BS] = k[pos], v[pos]
        query = torch.randn(180, HQ, D, generator=g)
        out = attention(query, layer, batch, scale=D ** -0.5)
        for rows, (n, _, _, _), (k, v) in zip((slice(0, 100), slice(100, 180)), seqs, kvs):
            want = dense_reference(query[rows], k, v, n, D ** -0.5)
            torch.testing.assert_close(out[rows], want, atol=1e-5, rtol=1e-5)
    assert built == ([120, 100] if kept else [120, 100] * layers), built


@pytest.mark.parametrize("q_len", [1, 5])
@pytest.mark.parametrize("window", [None, 5])
def test_one_short_query_sequence_matches_dense(q_len, window):
    """A decode step or a verification alone in its batch (the path without padding)."""
    layer, tables, kvs, g = build([(11, q_len, None, 0)])
    (k, v), table = kvs[0], tables[0]
    for pos in range(11):
        layer[table[pos // BS], 0, pos % BS] = k[pos]
        layer[table[pos // BS], 1, pos % BS] = v[pos]
    batch = plan_batch(tables, [q_len], [11], BS, torch.device("cpu"))
    query = torch.randn(q_len, HQ, D, generator=g)
    out = attention(query, layer, batch, scale=D ** -0.5, sliding_window=window)
    want = dense_reference(query, k, v, 11, D ** -0.5, window)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_a_cascade_group_shares_every_full_page_its_members_have_in_common():
    """Shared: the leading pages identical in every member's table and before every new token
    (fewer would attend the prefix once per sequence, more would be wrong)."""
    cpu = torch.device("cpu")
    tables = [[0, 1, 2, 3, 4, 10], [0, 1, 2, 5, 6, 11], [0, 1, 7, 8, 9, 12]]
    for members, kv_lens, shared in (([0, 1], [21, 21], 3), ([0, 1, 2], [21, 21, 21], 2),
                                     ([0, 1], [21, 9], 2)):  # the second's new token is in page 2
        batch = plan_batch([tables[i] for i in members], [1] * len(members), kv_lens, BS, cpu)
        assert [grp.num_pages for grp in batch.cascade_groups] == [shared]


def test_metadata_is_flashinfer_format():
    batch = plan_batch([[7, 3, 9], [7, 3, 5, 6]], [2, 1], [10, 13], BS, torch.device("cpu"))
    assert batch.qo_indptr.tolist() == [0, 2, 3] and batch.qo_indptr.dtype == torch.int32
    assert batch.kv_indptr.tolist() == [0, 3, 7]
    assert batch.kv_indices.tolist() == [7, 3, 9, 7, 3, 5, 6]
    assert batch.kv_last_page_len.tolist() == [2, 1]
    assert batch.positions.tolist() == [8, 9, 12]
    keys = [9 * 2 * BS + 0, 9 * 2 * BS + 1, 6 * 2 * BS + 0]  # pages 9, 9, 6; slots 0, 1, 0
    assert batch.write_slots.tolist() == keys + [k + BS for k in keys]  # then their V rows
    one, two = batch.decode  # buckets of 1 and of 2 new tokens
    assert batch.prefill == [] and one.rows.tolist() == [[2]] and two.rows.tolist() == [[0, 1]]
    assert one.positions.tolist() == [[12]] and two.positions.tolist() == [[8, 9]]
    long = plan_batch([list(range(SHORT_QUERY))], [SHORT_QUERY + 1], [SHORT_QUERY + 2], BS,
                      torch.device("cpu"))
    assert long.prefill == [0] and long.decode == []


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 80), st.integers(1, 3), st.integers(0, 3), st.integers(0, 80)),
                min_size=1, max_size=7), st.booleans())
def test_decode_plans_pad_pages_at_most_double(seqs, cascade):
    """Every short-query sequence lands in exactly one plan, and no plan pads a sequence's own
    pages to more than twice another's (or past 4 pages): one long lone sequence next to a
    cascade group does not make the group's members read its length. Attention stays exact."""
    spec = []
    for i, (n, q, parent, shared) in enumerate(seqs):
        q, parent = min(q, n), parent if i and parent < i else None
        share = min(shared, n - q, spec[parent][0] - spec[parent][1]) // BS * BS if parent is not None else 0
        spec.append((n, q, parent if share else None, share))
    layer, tables, kvs, g = build(spec, num_pages=160)
    q_lens, kv_lens = [q for _, q, _, _ in spec], [n for n, _, _, _ in spec]
    batch = plan_batch(tables, q_lens, kv_lens, BS, torch.device("cpu"), cascade=cascade)
    rows = sorted(r for plan in batch.decode for r in plan.rows[:, 0].tolist())
    starts = [sum(q_lens[:i]) for i in range(len(spec))]
    assert rows == sorted(starts[i] for i in range(len(spec)) if q_lens[i] <= SHORT_QUERY)
    for plan in batch.decode:
        own = [-(-n // BS) for n in plan.host_lens]
        assert max(own) <= 4 or max(own) <= 2 * min(own), own
    for table, (n, q, _, _), (k, v) in zip(tables, spec, kvs):
        for pos in range(n):
            layer[table[pos // BS], 0, pos % BS] = k[pos]
            layer[table[pos // BS], 1, pos % BS] = v[pos]
    query = torch.randn(sum(q_lens), HQ, D, generator=g)
    out = attention(query, layer, batch, scale=D ** -0.5)
    for (n, q, _, _), (k, v), start in zip(spec, kvs, starts):
        torch.testing.assert_close(out[start:start + q], dense_reference(query[start:start + q], k, v, n, D ** -0.5),
                                   atol=1e-5, rtol=1e-5)


def _same_metadata(a, b) -> bool:
    def same(x, y):
        if isinstance(x, torch.Tensor):
            return x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
        if isinstance(x, list):
            return len(x) == len(y) and all(same(u, v) for u, v in zip(x, y))
        if hasattr(x, "__slots__"):
            return type(x) is type(y) and all(same(getattr(x, f), getattr(y, f)) for f in x.__slots__)
        return x == y
    return same(a, b)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(0, 3), st.integers(0, 40)),
                min_size=1, max_size=5), st.booleans())
def test_next_position_equals_a_fresh_plan(seqs, cascade):
    """Moving a one-token-per-sequence batch on by a position gives exactly the plan of the next
    position, and declines when a page starts."""
    tables, kv_lens = [], []
    for i, (n, parent, shared) in enumerate(seqs):  # some sequences share leading pages
        share = min(shared, n) // BS if i and parent < i else 0
        table = tables[parent][:share] if share else []
        table = table + [100 * i + j for j in range(len(table), -(-(n + 1) // BS))]
        tables.append(table)
        kv_lens.append(n)
    batch = plan_batch(tables, [1] * len(seqs), kv_lens, BS, torch.device("cpu"), cascade=cascade)
    moved = next_position(batch)
    if any(n % BS == 0 for n in kv_lens):
        assert moved is None
    else:
        fresh = plan_batch(tables, [1] * len(seqs), [n + 1 for n in kv_lens], BS,
                           torch.device("cpu"), cascade=cascade)
        assert _same_metadata(moved, fresh)


@st.composite
def cross_sequences(draw):
    """Sequences with up to three images each (page lists sometimes shared between sequences),
    their new rows packed one after the other."""
    seqs, row = [], 0
    for i in range(draw(st.integers(1, 4))):
        images = []
        for j in range(draw(st.integers(0, 3))):
            pages = draw(st.sampled_from([[1, 2], [3], [100 + 10 * i + j]]))
            tokens = draw(st.integers(1, len(pages) * BS))
            start = draw(st.integers(0, 12))
            images.append((pages, tokens, draw(st.integers(1, tokens)), start,
                           draw(st.none() | st.integers(start + 1, 16))))
        first, q = draw(st.integers(0, 20)), draw(st.integers(1, 6))
        seqs.append(CrossSequence(rows=list(range(row, row + q)), positions=list(range(first, first + q)),
                                  prompt_len=draw(st.integers(1, 16)), images=images))
        row += q
    return seqs, row


@settings(max_examples=100, deadline=None)
@given(cross_sequences())
def test_cross_plan_follows_the_visibility_rule_row_by_row(case):
    """Every row's allowed image positions and MLP mask against a direct reading of the rule: image
    i is seen from its placeholder to its end; generated rows see what the last prompt token sees;
    a row that sees nothing attends to every image token and its output is masked."""
    seqs, num_rows = case
    plan = plan_cross(seqs, num_rows, BS, torch.device("cpu"), torch.float32)
    want, want_mask = {}, [0.0] * num_rows
    for seq in seqs:
        if not seq.images:
            continue
        pages = tuple(p for img in seq.images for p in img[0])
        for row, pos in zip(seq.rows, seq.positions):
            p = min(pos, seq.prompt_len - 1)
            allowed, every = [], []
            for img_pages, tokens, valid, start, end in seq.images:
                seen = start <= p and (end is None or p < end)
                allowed += [seen and k < valid for k in range(len(img_pages) * BS)]
                every += [k < tokens for k in range(len(img_pages) * BS)]
            want_mask[row] = float(any(allowed))
            want[row] = (pages, allowed if any(allowed) else every)
    got = {}
    for group in plan.groups:
        assert group.kv_len == len(group.pages) * BS
        for row, allowed in zip(group.rows.tolist(), group.allowed.tolist()):
            got[row] = (tuple(group.pages.tolist()), allowed)
    assert got == want
    assert plan.row_mask.tolist() == want_mask


@st.composite
def one_image_sequences(draw):
    """Sequences with at most one image each, all of whose rows see it (the case the native kernel
    attends in one call), some sharing their image's pages."""
    seqs, row = [], 0
    for i in range(draw(st.integers(1, 5))):
        images = []
        if draw(st.booleans()) or not i:
            pages = draw(st.sampled_from([[1, 2], [3], [4, 5, 6], [100 + i]]))
            valid = draw(st.integers(1, len(pages) * BS))
            images.append((pages, valid, valid, 0, None))
        q = draw(st.integers(1, 6))
        seqs.append(CrossSequence(rows=list(range(row, row + q)), positions=list(range(20, 20 + q)),
                                  prompt_len=10, images=images))
        row += q
    return seqs, row


@settings(max_examples=60, deadline=None)
@given(st.one_of(cross_sequences(), one_image_sequences()), st.sampled_from([torch.float32, torch.bfloat16]),
       st.integers(1, 4), st.sampled_from([1, 16, 4096]), st.integers(1, 3))
def test_cross_attention_matches_dense_over_each_rows_allowed_positions(case, dtype, most_rows, most_work,
                                                                        many_groups):
    """Every row's output is softmax attention (float64) over exactly its group's allowed image
    positions, read from the pages; rows without images get zeros. The plan asks for one kernel
    call exactly when every group's rows see one prefix of its positions and the groups have at
    most ``queries`` rows, or ``work`` rows x keys, or twice those rows when there are ``groups``
    of them (``OneCallLimits``, drawn here), and then the output is that call's."""
    seqs, num_rows = case
    plan = plan_cross(seqs, num_rows, BS, torch.device("cpu"), torch.float32,
                      OneCallLimits(most_rows, most_work, many_groups))
    prefixes = [[int(a.sum()) if bool(a[:int(a.sum())].all()) else -1 for a in g.allowed] for g in plan.groups]
    uniform = bool(prefixes) and all(min(p) == max(p) >= 0 for p in prefixes)
    rows = max((len(p) for p in prefixes), default=0)
    keys = max((p[0] for p in prefixes), default=0)
    short = (rows <= most_rows or rows * keys <= most_work
             or (len(prefixes) >= many_groups and rows <= 2 * most_rows))
    assert (plan.one_call is not None) == (uniform and short)
    g = torch.Generator().manual_seed(len(seqs) * 7 + num_rows)
    layer = torch.randn(140, 2, BS, HKV, D, generator=g).to(dtype)
    query = torch.randn(num_rows, HQ, D, generator=g).to(dtype)  # the model's dtype is the cache's
    scale = D ** -0.5
    out = torch_backend.cross_attention(query, layer, plan, scale)
    if plan.one_call is not None and native.supports(query.float(), layer):
        batch = plan.one_call  # the output is, bit for bit, one kernel call over every group
        d, m = batch.positions.shape
        kernel = native.paged_decode(query.float()[batch.queries].view(d, m, HQ, D), layer, batch.pages,
                                     batch.lens, batch.key_start, batch.positions, scale, None, None)
        kernel = kernel.view(d * m, HQ, D)[batch.slots if batch.slots is not None else slice(None)]
        assert torch.equal(out, torch.zeros_like(out).index_copy_(0, batch.rows, kernel.to(dtype)))
    want = torch.zeros(num_rows, HQ, D, dtype=torch.float64)
    for group in plan.groups:
        k = layer[group.pages, 0].reshape(-1, HKV, D).double().repeat_interleave(HQ // HKV, dim=1)
        v = layer[group.pages, 1].reshape(-1, HKV, D).double().repeat_interleave(HQ // HKV, dim=1)
        for row, allowed in zip(group.rows.tolist(), group.allowed):
            scores = torch.einsum("hd,khd->hk", query[row].double(), k) * scale
            weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
            want[row] = torch.einsum("hk,khd->hd", weights, v)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # torch's SDPA rounds to bfloat16
    torch.testing.assert_close(out.double(), want, atol=tolerance, rtol=tolerance)


def test_one_call_limits_hold_at_their_bounds():
    """The default rule at each bound: 8 rows a group over any keys; 4096 rows x keys; 4 groups
    of 16 rows."""
    allow = metadata.ONE_CALL.allow
    assert allow(1, 8, 10**6) and not allow(1, 9, 10**6)
    assert allow(1, 64, 64) and not allow(1, 64, 65)
    assert allow(4, 16, 10**6) and not allow(3, 16, 10**6) and not allow(4, 17, 10**6)
