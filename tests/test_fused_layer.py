"""mmkv's fused decoder layer against transformers' modules.

Each family runs the same requests (prompt chunks, decode steps, a shared prefix served by
cascade attention) through the fused layers and through transformers' own decoder layers,
capturing every step's logits. With plain ``F.linear`` (``MMKV_PACK_WEIGHTS=0``) and torch's
RMSNorm (``MMKV_NATIVE=0``) the fused layers (and the final norm and embedding lookup, run without
their modules' calls) equal the modules bit for bit; with weights packed for oneDNN and the native
RMSNorm (the CPU default) they agree to float rounding and give the same tokens.
"""

import pytest
import torch

from mmkv import SamplingParams, native
from mmkv.models import fused_layer, packed_linear
from mmkv.models.fused_layer import RMSNorm
from mmkv.models.packed_linear import ONE_THREAD, PACKED, PLAIN, PackedLinear, padded_rows, row_class
from test_engine_oracle import engine, prompts
from test_multimodal import q, vlm_engine
from tiny_models import FAMILIES, captured_logits
from tiny_vlms import picture

P = SamplingParams(max_tokens=8, ignore_eos=True)


def module_cross_layer(layer, hidden, step):
    """Mllama's cross-attention decoder layer through its own modules, over paged image K/V."""
    if step.cross is None:
        return hidden
    attn, t = layer.cross_attn, hidden.shape[1]
    q = attn.q_proj(layer.input_layernorm(hidden)).view(t, attn.num_heads, attn.head_dim)
    o = step.backend.cross_attention(step, attn.q_norm(q), step.kv_layers[layer.layer_idx],
                                     attn.scaling)
    hidden = hidden + layer.cross_attn_attn_gate.tanh() * attn.o_proj(o.reshape(1, t, -1))
    mlp = layer.mlp(layer.post_attention_layernorm(hidden))
    return hidden + layer.cross_attn_mlp_gate.tanh() * (step.cross.row_mask[None, :, None] * mlp)


def assert_same_as_modules(build, requests, monkeypatch) -> None:
    """``build()`` makes an engine; compared: packed fused layers, plain fused layers, modules
    (for cross-attention layers too, where the model has them). Each engine decodes on one thread
    count throughout (its steps exploring another would sum in another order)."""
    packed = build()
    packed.runner.decode_threads = None
    assert packed.model.fused and all(isinstance(f.qkv, PackedLinear) and f.input_norm.kernel is not None
                                      for f in packed.model.fused.values())
    packed_logits = captured_logits(packed, requests, P)
    monkeypatch.setenv("MMKV_PACK_WEIGHTS", "0")
    monkeypatch.setenv("MMKV_NATIVE", "0")  # torch's RMSNorm, as the modules run it
    native.library.cache_clear()
    try:
        plain = build()
    finally:
        native.library.cache_clear()
    plain.runner.decode_threads = None
    assert all(norm.kernel is None for f in plain.model.fused.values() for norm in (f.input_norm, f.mlp.norm))
    fused = captured_logits(plain, requests, P)
    plain.kv.tree.evict(plain.kv.pool.num_blocks)  # the second run reuses nothing cached
    plain.model.fused = {}
    plain.model.run_cross_layer = module_cross_layer
    plain.model.final_norm, plain.model._embedding = plain.model.text_model.norm, None  # modules
    modules = captured_logits(plain, requests, P)
    assert len(fused) == len(modules) == len(packed_logits) >= P.max_tokens
    for a, b, c in zip(fused, modules, packed_logits):
        assert torch.equal(a, b), (a - b).abs().max()
        torch.testing.assert_close(c, b, atol=1e-4, rtol=0)
        assert torch.equal(c.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_text_families(model_dirs, family, monkeypatch):
    [doc] = prompts(30, [37])
    requests = [doc + p for p in prompts(31, [3, 9, 20])] + prompts(32, [5])
    assert_same_as_modules(lambda: engine(model_dirs, family, max_num_batched_tokens=40), requests,
                           monkeypatch)


@pytest.mark.parametrize("family", ["mllama", "llava", "mmkv_vlm"])
def test_vision_language_families(vlm_dirs, family, monkeypatch):
    requests = [{"prompt": q(text), "images": [picture(50)]} for text in ("what?", "where is it?")]
    assert_same_as_modules(lambda: vlm_engine(vlm_dirs, family), requests + [list(b"text only prompt")],
                           monkeypatch)


def test_packed_layers_run_each_row_count_at_one_of_few_padded_counts():
    """oneDNN builds a primitive per row count (hundreds of microseconds, once each), and
    verification meets a new count almost every round: a packed layer pads its rows to one of at
    most 8 counts per doubling, at most an eighth more, and returns exactly its rows' outputs,
    whichever way it runs them."""
    counts = {padded_rows(rows) for rows in range(1, 4097)}
    for low in (16, 32, 64, 128, 256, 512, 1024, 2048):
        assert len({c for c in counts if low < c <= 2 * low}) <= 8
    assert all(rows <= padded_rows(rows) <= rows + max(0, rows - 1) // 8 + 1 for rows in range(1, 4097))
    assert [padded_rows(rows) for rows in range(1, 17)] == list(range(1, 17))
    torch.manual_seed(0)
    weight, bias = torch.randn(700, 128), torch.randn(700)
    layer = PackedLinear(weight, bias)
    for way in available_ways():
        for rows in (1, 7, 17, 23, 40, 41, 57, 130):
            x = torch.randn(rows, 128)
            torch.testing.assert_close(layer.run(x, way), torch.nn.functional.linear(x, weight, bias),
                                       rtol=1e-5, atol=1e-4)


def available_ways() -> list[str]:
    return [PACKED, PLAIN] + ([ONE_THREAD] if packed_linear._mkl_local_threads() is not None else [])


def test_calibration_runs_each_row_class_the_way_it_timed_fastest(monkeypatch):
    """Each row class takes the way with the least median time over the turns (one slow turn of
    the fastest way, a process on the same core, does not change its choice); classes whose
    work is past the calibration budget run packed."""
    monkeypatch.setattr(packed_linear, "_mkl_local_threads", lambda: lambda threads: 0)
    layer = PackedLinear(torch.randn(64, 32), None)
    now, turns = [0.0], {}

    def timed_run(x, way):  # plain wins on 1-2 rows, one thread on 3-114, packed on more
        rows = x.shape[0]
        turns[rows, way] = turns.get((rows, way), 0) + 1
        spike = 1000.0 if (rows, way, turns[rows, way]) == (1, PLAIN, 2) else 0.0
        now[0] += spike + {PACKED: 60.0, PLAIN: 2.0 + rows, ONE_THREAD: 3.0 + rows / 2}[way]

    layer.run = timed_run
    ways = layer.calibrate(clock=lambda: now[0])
    assert ways == (PLAIN, PLAIN) + (ONE_THREAD,) * 17 + (PACKED,)  # 1, 2 | 3 to 16, 24, 48, 96 | 192 rows
    assert [row_class(rows) for rows in (1, 16, 17, 32, 33, 256)] == [0, 15, 16, 16, 17, 19]
    monkeypatch.setattr(packed_linear, "CALIBRATION_WORK", 64 * 32 * 8)
    assert len(layer.calibrate(clock=lambda: now[0])) == 8  # 1 to 8 rows
    layer.ways, ran = (ONE_THREAD, PACKED), []
    layer.run = lambda x, way: ran.append((x.shape[0], way))
    for rows in (1, 2, 3, 300):
        layer(torch.zeros(rows, 32))
    assert ran == [(1, ONE_THREAD), (2, PACKED), (3, PACKED), (300, PACKED)]


@pytest.mark.parametrize("size", [24, 96, 100, 128, 1024])
def test_the_native_rms_norm_equals_transformers_norm_up_to_rounding(size):
    """On float32 rows (one to past the size where the kernel spreads rows over threads) the
    native RMSNorm agrees with transformers' module to float rounding; rows it does not take
    (bfloat16, not contiguous) get torch's, bit for bit."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(size)
    module = LlamaRMSNorm(size, eps=1e-5)
    module.weight.data = torch.randn(size)
    norm = RMSNorm.of(module)
    assert norm.kernel is not None
    for rows in (1, 3, 17, 64):
        x = torch.randn(rows, size) * 3
        torch.testing.assert_close(norm(x), module(x), rtol=2e-6, atol=1e-6)
    x = torch.randn(size, 8).t()
    assert torch.equal(norm(x), module(x))
    module_bf16 = LlamaRMSNorm(size, eps=1e-5).to(torch.bfloat16)
    x = torch.randn(5, size, dtype=torch.bfloat16)
    assert torch.equal(RMSNorm.of(module_bf16)(x), module_bf16(x))


@pytest.mark.parametrize("tokens, q_heads, kv_heads, dim", [(1, 4, 4, 32), (5, 8, 2, 64), (300, 4, 1, 128)])
def test_the_native_rotary_and_kv_write_equal_the_torch_paths(tokens, q_heads, kv_heads, dim):
    """``mmkv_rope_write`` rotates the queries and keys of a fused Q/K/V output (rows with a
    stride past their end, as a padded GEMM output has) as ``rotate`` does, to float rounding,
    and stores the keys and values in the slots the torch backend's ``write_kv`` would, touching
    no other element (300 tokens: spread over threads)."""
    kernel = native.function("mmkv_rope_write", fused_layer._ROPE_WRITE_ARGS, None)
    torch.manual_seed(tokens)
    width = (q_heads + 2 * kv_heads) * dim
    qkv = torch.randn(tokens, width + 8)[:, :width]
    both = torch.randn(tokens, 2, dim)
    cos, sin = both[:, :1], both[:, 1:]
    layer = torch.full((tokens, 2, 16, kv_heads, dim), 7.0)
    slots = torch.randperm(layer.numel() // (kv_heads * dim))[:2 * tokens]
    want = layer.clone()
    qk = fused_layer.rotate(qkv[:, :(q_heads + kv_heads) * dim].view(tokens, -1, dim), cos, sin)
    v = qkv[:, (q_heads + kv_heads) * dim:].reshape(tokens, kv_heads, dim)
    want.view(-1, kv_heads, dim).index_copy_(0, slots, torch.cat((qk[:, q_heads:], v)))
    q = torch.empty(tokens, q_heads, dim)
    kernel(qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), cos.stride(0), sin.data_ptr(), sin.stride(0),
           q.data_ptr(), layer.data_ptr(), slots.data_ptr(), tokens, q_heads, kv_heads, dim)
    torch.testing.assert_close(q, qk[:, :q_heads], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(layer, want, rtol=1e-6, atol=1e-6)


def test_a_bfloat16_layer_is_packed_on_every_processor():
    """oneDNN reorders a bfloat16 weight only where the processor has its bfloat16 path (AVX-512
    BW/VL/DQ or AVX-NE-CONVERT) and raises on AVX2 alone, where ``F.linear`` in bfloat16 runs
    several times slower than float32: there the layer packs the weight's float32 upcast and
    rounds its outputs back, giving the bfloat16 layer's outputs either way."""
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64, dtype=torch.bfloat16), torch.randn(96, dtype=torch.bfloat16)
    layer = packed_linear.make_linear(weight, bias, pack=True)
    assert isinstance(layer, PackedLinear) and layer.upcast != packed_linear.bfloat16_packs()
    for rows in (1, 5, 40):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        out = layer(x)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, bias), rtol=1e-2, atol=1e-2)
