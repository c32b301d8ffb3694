"""The FlashInfer backend on a CPU: its plans executed by the pure-torch reference of FlashInfer
(``flashinfer_reference``), every call bound against FlashInfer's recorded signatures.

What runs only on a GPU (the kernels themselves) is checked by ``tests/gpu``.
"""

from collections import Counter

import pytest
import torch

import flashinfer_reference
from flashinfer_api import bind
from mmkv import Engine, SamplingParams
from mmkv.attention import flashinfer_backend as fb
from mmkv.attention.flashinfer_backend import FlashInferBackend, Heads
from mmkv.attention.metadata import CrossSequence, plan_batch, plan_cross
from mmkv.attention.torch_backend import TorchBackend, attention, cross_attention, write_kv
from mmkv.step_context import StepContext
from speculative import SpeculativeConfig
from test_engine_oracle import BLOCK_BYTES, GREEDY, assert_matches_oracle, prompts
from test_multimodal import BLOCK_BYTES as VLM_BLOCK_BYTES, P, hf_models, oracle, q  # noqa: F401
from test_torch_attention import BS, D, HKV, HQ, build
from tiny_models import LEARNING
from tiny_vlms import picture

CPU = torch.device("cpu")
META = torch.device("meta")  # stands for the GPU: a meta tensor cannot be read on the host


class RecordingBackend(FlashInferBackend):
    """The FlashInfer backend over the reference kernels, counting the calls it makes."""

    def __init__(self) -> None:
        super().__init__(CPU, kernels=flashinfer_reference, workspace_bytes=16)
        self.calls: Counter[str] = Counter()

    def _call(self, call, wrapper=None):
        self.calls[call.target] += 1
        return super()._call(call, wrapper)


def fi_engine(directory, blocks=512, block_bytes=BLOCK_BYTES, **kw) -> tuple[Engine, RecordingBackend]:
    backend = RecordingBackend()
    eng = Engine(directory, kv_cache_memory=blocks * block_bytes, host_kv_memory=blocks * block_bytes,
                 block_size=4, device="cpu", debug=True, attention_backend=backend, **kw)
    return eng, backend


def test_engine_over_the_reference_kernels_equals_transformers(model_dirs, hf_oracle):
    """Mixed prefill and decode, decode-only steps, prefix hits and cascade over shared pages,
    chunked prefill: greedy output token for token transformers' (fp32)."""
    eng, backend = fi_engine(model_dirs["llama"], max_num_batched_tokens=40)
    [doc] = prompts(50, [30])
    batch = [doc + p for p in prompts(51, [3, 5, 9])] + prompts(52, [1, 7, 45])
    assert_matches_oracle(eng.generate(batch, GREEDY), batch, "llama", hf_oracle)
    again = [doc + p for p in prompts(53, [2, 4, 6, 8])]
    assert_matches_oracle(eng.generate(again, GREEDY), again, "llama", hf_oracle)
    assert eng.stats()["cached_prompt_tokens"] >= 4 * 28 and eng.stats()["blocks_in_use"] == 0
    calls = backend.calls
    for target in ("BatchPrefillWithPagedKVCacheWrapper.plan", "BatchPrefillWithPagedKVCacheWrapper.run",
                   "BatchDecodeWithPagedKVCacheWrapper.plan", "BatchDecodeWithPagedKVCacheWrapper.run",
                   "append_paged_kv_cache", "merge_state"):
        assert calls[target] > 0, target
    # one plan per pattern per step, one run per layer: far fewer plans than runs
    assert calls["BatchDecodeWithPagedKVCacheWrapper.plan"] * 2 <= calls["BatchDecodeWithPagedKVCacheWrapper.run"]


def test_sliding_window_model_over_the_reference_kernels(model_dirs, hf_oracle):
    """Mistral's window (24) is shorter than these sequences: FlashInfer's window_left."""
    eng, _ = fi_engine(model_dirs["mistral"])
    batch = prompts(54, [30, 12, 41])
    assert_matches_oracle(eng.generate(batch, GREEDY), batch, "mistral", hf_oracle)


def test_early_exit_speculation_over_the_reference_kernels(model_dirs, hf_oracle):
    [doc] = prompts(55, [21])
    batch = [doc + p for p in prompts(56, [3, 4, 5])] + prompts(57, [9])
    eng, backend = fi_engine(model_dirs["llama"], speculative=SpeculativeConfig(num_tokens=4,
                                                                                early_exit_layer=1,
                                                                                settings=LEARNING))
    outs = eng.generate(batch, SamplingParams(max_tokens=24, ignore_eos=True))
    for p, o in zip(batch, outs):
        assert o.token_ids == hf_oracle("llama", p, 24)
    assert eng.stats()["spec_rounds"] > 0 and eng.stats()["blocks_in_use"] == 0


def test_draft_model_speculation_over_the_reference_kernels(model_dirs, hf_oracle, tmp_path):
    from tiny_models import build_model

    draft = build_model("llama", tmp_path / "draft", seed=3, num_hidden_layers=1)
    eng, _ = fi_engine(model_dirs["llama"], blocks=1024,
                       speculative=SpeculativeConfig(method="draft_model", draft_model=str(draft),
                                                     num_tokens=3, settings=LEARNING))
    batch = prompts(58, [6, 13])
    outs = eng.generate(batch, SamplingParams(max_tokens=24, ignore_eos=True))
    for p, o in zip(batch, outs):
        assert o.token_ids == hf_oracle("llama", p, 24)
    assert eng.stats()["spec_rounds"] > 0


def test_fp8_kv_over_the_reference_kernels_equals_the_torch_backend(model_dirs):
    """``kv_cache_dtype="fp8_e4m3"``: the plans say the cache's fp8 (the reference refuses a run
    whose cache is not what the plan said), appends write fp8, and greedy output over prefix hits
    and decode equals the torch backend's over the same fp8 cache."""
    [doc] = prompts(59, [30])
    batch = [doc + p for p in prompts(60, [3, 5, 9])] + prompts(61, [7, 45])
    eng, backend = fi_engine(model_dirs["llama"], max_num_batched_tokens=40, kv_cache_dtype="fp8_e4m3")
    torch_eng = Engine(model_dirs["llama"], block_size=4, device="cpu", kv_cache_dtype="fp8_e4m3")
    assert eng.kv.storage.layers[0].dtype == torch.float8_e4m3fn
    assert [o.token_ids for o in eng.generate(batch, GREEDY)] == [
        o.token_ids for o in torch_eng.generate(batch, GREEDY)]
    assert backend.calls["append_paged_kv_cache"] > 0 and backend.calls["merge_state"] > 0


@pytest.mark.parametrize("family", ["mllama", "mmkv_vlm"])
def test_cross_attention_over_the_reference_kernels(vlm_dirs, hf_models, family):
    """Image K/V written with append_paged_kv_cache, read by the cross wrapper (Mllama: rows
    before the image see all its tiles, the others the valid ones: a custom mask)."""
    eng, backend = fi_engine(vlm_dirs[family], blocks=1024, block_bytes=VLM_BLOCK_BYTES[family])
    images = [picture(1), picture(2, size=(30, 50))]
    questions = [q("What is it?"), q("How many?", before="Hi "), q("Where?")]
    requests = [{"prompt": p, "images": [img]} for img in images for p in questions]
    outs = eng.generate(requests + [list(b"text only")], P)
    for req, out in zip(requests, outs):
        assert out.token_ids == oracle(family, hf_models, eng, req["prompt"], req["images"])
    assert backend.calls["append_paged_kv_cache"] > 0 and eng.stats()["blocks_in_use"] == 0


# -- one pattern at a time against the torch backend, on the same pages ---------------------------

MIXED = [(13, 13, None, 0), (40, 20, None, 0), (19, 1, None, 0), (21, 1, 2, 16), (17, 1, 2, 16),
         (22, 6, 2, 16), (19, 5, 2, 16), (9, 1, None, 0)]
DECODES = [(19, 1, None, 0), (21, 1, 0, 16), (23, 1, 0, 16), (9, 1, None, 0), (26, 1, 0, 12)]


def _step(seqs, cascade, window=None):
    layer, tables, kvs, g = build(seqs)
    q_lens = [s[1] for s in seqs]
    batch = plan_batch(tables, q_lens, [s[0] for s in seqs], BS, CPU, cascade=cascade)
    for table, (n, qn, _, _), (k, v) in zip(tables, seqs, kvs):
        for pos in range(n - qn):
            layer[table[pos // BS], :, pos % BS] = torch.stack([k[pos], v[pos]])
    new_k = torch.cat([k[n - qn:] for (n, qn, _, _), (k, _) in zip(seqs, kvs)])
    new_v = torch.cat([v[n - qn:] for (n, qn, _, _), (_, v) in zip(seqs, kvs)])
    return layer, batch, new_k, new_v, torch.randn(sum(q_lens), HQ, D, generator=g)


@pytest.mark.parametrize("seqs, cascade, window, pattern", [
    (MIXED, True, None, "prefill"), (MIXED, False, None, "prefill"), (MIXED, False, 5, "prefill"),
    (DECODES, True, None, "decode"), (DECODES, False, 7, "decode")])
def test_each_self_attention_pattern_equals_the_torch_backend(seqs, cascade, window, pattern):
    layer, batch, new_k, new_v, query = _step(seqs, cascade)
    want_layer = layer.clone()
    write_kv(want_layer, batch, new_k, new_v)
    want = attention(query, want_layer, batch, D ** -0.5, window)
    backend = RecordingBackend()
    step = StepContext(batch, [layer], backend)
    backend.write_kv(step, layer, new_k, new_v)
    assert torch.equal(layer, want_layer)
    got = backend.attention(step, query, layer, D ** -0.5, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    plan = step.plans[Heads.of(query, layer, D ** -0.5, window)]
    assert plan.pattern == pattern and (plan.shared is not None) == cascade
    assert backend.calls["merge_state"] == cascade


def _cross_case(block_size=BS):
    seqs = [CrossSequence(rows=[0, 1, 2], positions=[0, 1, 2], prompt_len=3,
                          images=[([10, 11], 6, 4, 1, None)]),  # row 0 sees nothing: all 6 tokens
            CrossSequence(rows=[3], positions=[7], prompt_len=5, images=[]),
            CrossSequence(rows=[4, 5], positions=[4, 5], prompt_len=9,
                          images=[([10, 11], 6, 4, 0, None), ([12], 3, 3, 5, None)]),
            CrossSequence(rows=[6], positions=[9], prompt_len=4, images=[([10, 11], 6, 4, 1, None)])]
    return seqs, 7


@pytest.mark.parametrize("uniform", [False, True])
def test_cross_attention_equals_the_torch_backend(uniform):
    seqs, rows = _cross_case()
    if uniform:  # rows that all see the same positions: no custom mask
        seqs = [s for s in seqs if s.rows[0] in (3, 6)]
    cross = plan_cross(seqs, rows, BS, CPU, torch.float32)
    g = torch.Generator().manual_seed(1)
    layer = torch.randn(16, 2, BS, HKV, D, generator=g)
    query = torch.randn(rows, HQ, D, generator=g)
    backend = RecordingBackend()
    step = StepContext(plan_batch([[0]], [1], [1], BS, CPU), [layer], backend, cross=cross)
    got = backend.cross_attention(step, query, layer, D ** -0.5)
    torch.testing.assert_close(got, cross_attention(query, layer, cross, D ** -0.5), atol=1e-5, rtol=1e-5)
    plan = step.plans[("cross", Heads.of(query, layer, D ** -0.5))]
    assert ("custom_mask" in plan.plan.kwargs) == (not uniform)


def test_image_kv_writes_equal_the_torch_backend():
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(7, HKV, D, generator=g), torch.randn(7, HKV, D, generator=g)
    want, got = torch.zeros(8, 2, BS, HKV, D), torch.zeros(8, 2, BS, HKV, D)
    TorchBackend().write_image_kv(want, [5, 2, 7], 3, k[3:], v[3:])
    RecordingBackend().write_image_kv(got, [5, 2, 7], 3, k[3:], v[3:])
    assert torch.equal(got, want) and want[2].abs().sum() > 0


# -- every call, as it would go to the GPU ---------------------------------------------------------

def _calls_on(device: torch.device) -> list[fb.Call]:
    """Every call the backend makes for a mixed step and a decode step, each with and without
    cascade, and a cross step, built with the device tensors on ``device``."""
    seqs = [(13, 13, None, 0), (21, 1, None, 0), (23, 1, 1, 16), (22, 6, 1, 16)]
    _, tables, _, _ = build(seqs)
    layer = torch.zeros(64, 2, BS, HKV, 64, dtype=torch.bfloat16, device=device)
    workspace = torch.zeros(16, dtype=torch.uint8, device=device)
    calls = [fb.wrapper_call(p, workspace) for p in fb.PATTERNS]
    for q_lens, cascade in [(q, c) for q in ([13, 1, 1, 6], [1, 1, 1, 1]) for c in (True, False)]:
        kv_lens = [n - q + ql for (n, q, _, _), ql in zip(seqs, q_lens)]
        batch = plan_batch(tables, q_lens, kv_lens, BS, device, cascade=cascade)
        query = torch.zeros(sum(q_lens), HQ, 64, dtype=torch.bfloat16, device=device)
        key = torch.zeros(sum(q_lens), HKV, 64, dtype=torch.float32, device=device)  # cast on append
        heads = Heads.of(query, layer, 0.125, 4096)
        plan = fb.plan_self_attention(batch, heads)
        calls += [plan.main, fb.run_call(plan.pattern, query, layer, True),
                  fb.append_call(key, key, fb.append_index(batch), layer)]
        if plan.shared is not None:
            q0 = query if plan.shared_rows is None else query.index_select(0, plan.shared_rows)
            lse = torch.zeros(q0.shape[:2], device=device)
            calls += [plan.shared, fb.run_call("shared", q0, layer, True), fb.merge_call(q0, lse, q0, lse)]
    seqs, rows = _cross_case()
    cross = plan_cross(seqs, rows, BS, device, torch.bfloat16)
    query = torch.zeros(rows, HQ, 64, dtype=torch.bfloat16, device=device)
    plan = fb.plan_cross_attention(cross, Heads.of(query, layer, 0.125))
    calls += [plan.plan, fb.run_call("cross", query.index_select(0, plan.rows), layer, False),
              fb.append_call(key[:3], key[:3], fb.image_append_index([3, 4], 5, 8, BS, device), layer)]
    return calls


def test_every_call_binds_to_flashinfer_with_host_plans_and_device_data():
    """Plans get host int32 index arrays and the dtypes said by keyword; runs, appends and merges
    get device tensors (int32 indices, K/V in the cache's dtype). Built with the device on
    ``meta``, so the backend never reads a device tensor on the host."""
    calls = _calls_on(META)
    targets = Counter(c.target.rsplit(".", 1)[-1] for c in calls)
    assert targets["plan"] == 7 and targets["__init__"] == 4 and targets["merge_state"] == 2
    for call in calls:
        bound = bind(call.target, call.args, call.kwargs).arguments
        method = call.target.rsplit(".", 1)[-1]
        if method == "plan":
            decode = "Decode" in call.target  # no qo_indptr: one query per request
            indices = [t for t in call.args if isinstance(t, torch.Tensor)]
            assert len(indices) == 4 - decode
            assert all(t.dtype == torch.int32 and t.device == CPU for t in indices)
            assert len(call.args) == 8 - decode  # options by keyword only
            assert call.kwargs["q_data_type"] == call.kwargs["kv_data_type"] == torch.bfloat16
            assert bound.get("custom_mask") is None or bound["custom_mask"].device == META
        elif method == "__init__":
            assert bound["float_workspace_buffer"].device == META and bound["backend"] == "fa2"
        elif call.target == "append_paged_kv_cache":
            cache = bound["paged_kv_cache"]
            assert bound["append_key"].dtype == bound["append_value"].dtype == cache.dtype
            for name in ("batch_indices", "positions", "kv_indices", "kv_indptr", "kv_last_page_len"):
                assert bound[name].dtype == torch.int32 and bound[name].device == META, name
        else:
            assert all(t.device == META for t in call.args if isinstance(t, torch.Tensor))
    assert any("custom_mask" in c.kwargs for c in calls)  # the cross plan needed one


def test_bad_calls_do_not_bind():
    """The binding checks can fail: causal given to run(), a misspelt option, a decode option
    passed positionally."""
    q = torch.zeros(1, HQ, 64)
    with pytest.raises(TypeError):
        bind("BatchPrefillWithPagedKVCacheWrapper.run", (q, q), {"causal": True})
    with pytest.raises(TypeError):
        bind("BatchDecodeWithPagedKVCacheWrapper.plan", (q,) * 7, {"q_dtype": torch.bfloat16})
    with pytest.raises(TypeError):
        bind("append_paged_kv_cache", (q,) * 8, {"layout": "NHD"})


# -- choosing the backend ----------------------------------------------------------------------------

def test_auto_is_the_torch_backend_and_unknown_names_are_refused(model_dirs):
    kw = dict(kv_cache_memory="1MiB", host_kv_memory="1MiB", device="cpu")
    assert isinstance(Engine(model_dirs["llama"], **kw).attention, TorchBackend)
    assert isinstance(Engine(model_dirs["llama"], attention_backend="torch", **kw).attention, TorchBackend)
    with pytest.raises(ValueError, match="attention_backend must be one of 'auto', 'torch', 'flashinfer'"):
        Engine(model_dirs["llama"], attention_backend="flash", **kw)


def test_flashinfer_refuses_cpu_float32_and_odd_head_dims(model_dirs):
    kw = dict(kv_cache_memory="1MiB", host_kv_memory="1MiB", attention_backend="flashinfer")
    with pytest.raises(ValueError) as err:
        Engine(model_dirs["llama"], device="cpu", **kw)
    message = str(err.value)
    assert "CUDA devices only, this engine's device is cpu" in message
    assert "float16 or bfloat16 only, this model's dtype is float32" in message
    assert "head_dim must be one of 64, 128, 256, this model's is 16" in message
    with pytest.raises(ValueError) as err:
        Engine(model_dirs["llama"], device="cpu", dtype="bfloat16", **kw)
    assert "dtype" not in str(err.value) and "cpu" in str(err.value)
    assert fb.unsupported(torch.device("cuda"), torch.bfloat16, 128) == []
    assert len(fb.unsupported(torch.device("cuda"), torch.float32, 96)) == 2
