"""Quantized weights: the layouts' formula, the kernels against the dequantized weight, and every
family's greedy output against transformers on the same model with its linear weights replaced
by their dequantized values (a quantized model is a model of its own)."""

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T
from gguf_files import raw_blocks
from transformers import LlavaForConditionalGeneration, MllamaForConditionalGeneration

from mmkv import Engine, SamplingParams, native
from mmkv.models import MmkvVLM
from mmkv.quantization import (Int4Weight, Int8Weight, Quantization, QuantizedLinear,
                               QuantizedLinearModule, quantize)
from mmkv.quantization.linear import NATIVE_ROWS
from mmkv.quantization.gguf import repack
from mmkv.quantization.loading import quantizes
from speculative import SpeculativeConfig
from tiny_models import LEARNING, hf_greedy, load_hf
from tiny_qwen_vl import build_qwen_vl, hf_greedy as qwen_greedy, load_oracle, picture as qwen_picture
from tiny_vlms import IMAGE_TOKEN, llava_greedy, mllama_greedy, mmkv_vlm_plain_greedy, picture

METHODS = ("int8", "int4")
P = SamplingParams(max_tokens=16, ignore_eos=True)
PROMPTS = [[(7 * i + 3) % 250 for i in range(n)] for n in (5, 23, 41)]


def dequantized(model: torch.nn.Module, method: str) -> torch.nn.Module:
    """``model`` with every linear weight mmkv quantizes replaced by its dequantized value."""
    with torch.no_grad():
        for name, module in model.named_modules():
            if type(module) is torch.nn.Linear and quantizes(name):
                module.weight.copy_(quantize(module.weight, Quantization(method)).dequantize())
    return model


def quantized_layers(engine: Engine) -> int:
    return sum(isinstance(m, QuantizedLinearModule) for m in engine.model.model.modules())


# -- the layouts -----------------------------------------------------------------------------------
def test_int4_layout_is_the_documented_formula():
    """Byte j holds input 2j in its low nibble; each group has its own scale and offset."""
    codes = torch.tensor([[0x21, 0xF0, 0x03, 0x54]], dtype=torch.uint8)  # 8 inputs, groups of 4
    w = Int4Weight(codes, torch.tensor([[0.5, 2.0]]).half(), torch.tensor([[-1.0, 3.0]]).half(), 4)
    expected = [1 * 0.5 - 1, 2 * 0.5 - 1, 0 * 0.5 - 1, 15 * 0.5 - 1, 3 * 2 + 3, 0 * 2 + 3, 4 * 2 + 3, 5 * 2 + 3]
    assert w.dequantize()[0].tolist() == expected
    assert w.unpacked_codes()[0].tolist() == [1, 2, 0, 15, 3, 0, 4, 5]


@pytest.mark.parametrize("seed", range(4))
def test_codes_are_the_nearest_under_the_stored_scales(seed):
    torch.manual_seed(seed)
    w = torch.randn(24, 128) * (1 + seed)
    w[3] = 0.0  # an all-zero channel and group
    q8 = quantize(w, Quantization("int8"))
    assert q8.codes.abs().max() <= 127
    assert ((q8.dequantize() - w).abs() <= q8.scale[:, None] / 2 * (1 + 1e-5)).all()
    q4 = quantize(w, Quantization("int4", 32))
    step = q4.scale.float().repeat_interleave(32, 1)
    offset = q4.offset.float().repeat_interleave(32, 1)
    inside = (w >= offset) & (w <= offset + 15 * step)  # outside: clamped by the float16 rounding
    assert ((q4.dequantize() - w).abs()[inside] <= step[inside] / 2 * (1 + 1e-3)).all()
    assert (q4.dequantize() - w).abs().max() <= step.max()


def test_bad_requests_name_what_is_wrong(model_dirs):
    with pytest.raises(ValueError, match="quantization must be one of int8, int4"):
        Engine(model_dirs["llama"], quantization="int3")
    with pytest.raises(ValueError, match="positive even integer, got 7"):
        Engine(model_dirs["llama"], quantization="int4", quantization_group_size=7)



def test_int4_layers_whose_inputs_the_group_does_not_tile_fall_back_to_int8(model_dirs):
    """Groups of 128 tile the MLP's down projection (128 inputs) only: every other layer (64
    inputs) is int8, and the fused layers still run one layout each."""
    eng = Engine(model_dirs["llama"], quantization="int4", quantization_group_size=128,
                 kv_cache_memory="4MiB")
    layers = {n.rsplit(".", 1)[-1]: m.method for n, m in eng.model.model.named_modules()
              if isinstance(m, QuantizedLinearModule)}
    assert layers == {"q_proj": "int8", "k_proj": "int8", "v_proj": "int8", "o_proj": "int8",
                      "gate_proj": "int8", "up_proj": "int8", "down_proj": "int4"}
    oracle = load_hf(model_dirs["llama"])
    with torch.no_grad():
        for name, module in oracle.named_modules():
            if type(module) is torch.nn.Linear and quantizes(name):
                module.weight.copy_(quantize(module.weight, Quantization("int4", 128)).dequantize())
    assert eng.generate([PROMPTS[2]], P)[0].token_ids == hf_greedy(oracle, PROMPTS[2], P.max_tokens)


# -- the kernels -----------------------------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, NATIVE_ROWS, NATIVE_ROWS + 1])
def test_layer_computes_with_the_dequantized_weight(method, rows):
    """Whichever way a row count runs (the native kernel up to ``NATIVE_ROWS`` rows, the weight
    dequantized beyond), the layer is ``F.linear`` of the dequantized weight; 37 outputs and 96
    inputs leave tails in every blocking, three groups of 32 give each its own scale."""
    torch.manual_seed(rows)
    w, bias, x = torch.randn(37, 96), torch.randn(37), torch.randn(rows, 96)
    layer = QuantizedLinear(quantize(w, Quantization(method)), bias)
    assert (layer.kernels is not None) == (native.library() is not None)
    expected = F.linear(x.double(), layer.weight.dequantize().double(), bias.double())
    for way in ((layer.native, layer.dense) if layer.kernels else (layer.dense,)):
        assert torch.allclose(way(x).double(), expected, atol=1e-4), way.__name__
    assert torch.allclose(layer(x).double(), expected, atol=1e-4)
    assert torch.equal(layer.dequantized(), layer.weight.dequantize())


@pytest.mark.parametrize("method, group", [("int8", 32), ("int4", 32), ("int4", 64)])
@pytest.mark.parametrize("rows", [1, 4, 6, 8, 17, 40])
def test_bfloat16_rows_meet_the_weight_in_bfloat16(method, group, rows):
    """bfloat16 rows go through the dot-product kernel or AMX tiles where the CPU has them: int8
    codes are exact in bfloat16 (the scale multiplies the sum), an int4 weight is its dequantized
    value rounded to bfloat16, as the bfloat16 model holds it; sums in float32. 192 inputs are
    three of the int4 kernel's 64-input steps: at group 32 each step spans two groups, at 64 one.
    37 channels are two whole tile blocks and a partial one; 17 and 40 rows fill a second row
    tile and a second pass over the blocks."""
    torch.manual_seed(rows)
    w, bias, x = torch.randn(37, 192), torch.randn(37).bfloat16(), torch.randn(rows, 192).bfloat16()
    layer = QuantizedLinear(quantize(w, Quantization(method, group)), bias)  # a bfloat16 model's bias
    if layer.kernels is None or layer.run_kernel(layer.kernels[1], x) is None:
        pytest.skip("no AVX512-BF16 kernel on this CPU (the float32 kernel runs bfloat16 rows)")
    weight = layer.weight.dequantize()
    if method == "int4":
        weight = weight.bfloat16()
    expected = F.linear(x.double(), weight.double(), bias.double())
    assert torch.allclose(layer.run_kernel(layer.kernels[1], x).double(), expected, atol=1e-4)
    assert layer(x).dtype == torch.bfloat16
    assert torch.equal(layer.dequantized(torch.bfloat16), layer.weight.dequantize().bfloat16())


@pytest.mark.parametrize("method, group", [("int8", 32), ("int4", 32), ("int4", 64)])
@pytest.mark.parametrize("path, rows", [("native", 1), ("native", 6), ("dense", NATIVE_ROWS + 3)])
def test_bfloat16_rows_run_either_way_with_the_weight_each_way_holds(method, group, path, rows):
    """bfloat16 rows on either path, either way: the bfloat16 way multiplies the weight rounded
    to bfloat16 (the int8 kernel's codes are exact, its scale multiplies the sum), the float32 way
    the weight itself; each sums in float32 and rounds the result to bfloat16. The ways differ by
    the weight's rounding (about 2^-9 of a product), far more than either's error here."""
    torch.manual_seed(rows)
    w, bias, x = torch.randn(37, 192), torch.randn(37).bfloat16(), torch.randn(rows, 192).bfloat16()
    layer = QuantizedLinear(quantize(w, Quantization(method, group)), bias)  # a bfloat16 model's bias
    run = getattr(layer, path)
    exact = layer.weight.dequantize()
    rounded = exact if (method, path) == ("int8", "native") else exact.bfloat16()
    for way, weight in (("float32", exact), ("bfloat16", rounded)):
        if way == "bfloat16" and path == "native" and (
                layer.kernels is None or layer.run_kernel(layer.kernels[1], x) is None):
            continue  # no AVX512-BF16 kernel on this CPU: the native path runs float32 only
        expected = F.linear(x.double(), weight.double(), bias.double())
        got = run(x, way)
        assert got.dtype == torch.bfloat16
        # the result's own rounding to bfloat16 is 2^-9 of it; the sums' float32 error is far less
        torch.testing.assert_close(got.double(), expected.bfloat16().double(), rtol=2 ** -8, atol=1e-6)
        other = F.linear(x.double(), (rounded if way == "float32" else exact).double(), bias.double())
        if not torch.equal(rounded, exact):  # the ways are told apart by the weight they hold
            assert (got.double() - expected).abs().sum() < (got.double() - other).abs().sum(), way


@pytest.mark.parametrize("way", ["bfloat16", "float32"])
def test_a_layer_runs_bfloat16_rows_the_way_timed_faster_here(monkeypatch, way):
    """Each path's ways are timed once per process at each of its timed row counts, and every
    call after follows the timing nearest its rows; here the answers are set (the other way at 16
    rows natively, ``way`` at the other counts), then read back from what the layer computes."""
    from mmkv.quantization import linear

    monkeypatch.setattr(linear, "_FASTER_WAY", {})
    assert linear.bfloat16_way("dense", linear.FLOAT32_DENSE_ROWS) in linear.BFLOAT16_WAYS  # timed: any
    other = next(w for w in linear.BFLOAT16_WAYS if w != way)
    timed = []

    def answer(path, rows):
        timed.append((path, rows))
        return other if (path, rows) == ("native", 16) else way

    monkeypatch.setattr(linear, "time_bfloat16_ways", answer)
    monkeypatch.setattr(linear, "_FASTER_WAY", {})
    torch.manual_seed(0)
    layer = QuantizedLinear(quantize(torch.randn(37, 192), Quantization("int4")), None)
    for rows in (1, 3, 5, 8, 12, NATIVE_ROWS, NATIVE_ROWS + 3, linear.FLOAT32_DENSE_ROWS):
        x = torch.randn(rows, 192).bfloat16()
        if layer.kernels and rows <= NATIVE_ROWS:  # 3 and 5 rows nearest 4; 8 (a tie), 12, 32 at 16
            path, expected_way = layer.native, way if rows < 8 else other
        else:  # a short dense call stays bfloat16 whatever was timed
            path, expected_way = layer.dense, "bfloat16" if rows < linear.FLOAT32_DENSE_ROWS else way
        for _ in range(2):
            assert torch.equal(layer(x), path(x, expected_way)), (rows, way)
    dense = [("dense", 2 * linear.FLOAT32_DENSE_ROWS)]
    native = [("native", 1), ("native", 4), ("native", 16)]
    assert sorted(timed) == (dense + native if layer.kernels else dense)


@pytest.mark.parametrize("tiles", [0, 8], ids=["no-amx", "amx"])
def test_bfloat16_rows_past_native_rows_run_natively_only_as_tiles(monkeypatch, tiles):
    """Up to ``TILE_ROWS`` bfloat16 rows run natively where the native bfloat16 way runs as AMX
    tiles (set here: the routing is the same on any CPU) and was timed the faster; float32 rows,
    rows past ``TILE_ROWS``, a CPU without tiles or a timing for float32 go dense."""
    from mmkv.quantization import linear

    torch.manual_seed(0)
    layer = QuantizedLinear(quantize(torch.randn(37, 192), Quantization("int4")), None)
    if layer.kernels is None:
        pytest.skip("no native library")
    layer.tiles = tiles
    ran = []
    for name in ("native", "dense"):
        monkeypatch.setattr(layer, name, (lambda run, name: lambda x, way=None: ran.append(name) or run(x, way))(
            getattr(layer, name), name))
    for way in linear.BFLOAT16_WAYS:
        monkeypatch.setattr(linear, "_FASTER_WAY", {("native", 16): way})
        for rows, dtype in ((linear.TILE_ROWS, torch.bfloat16), (NATIVE_ROWS + 1, torch.bfloat16),
                            (linear.TILE_ROWS, torch.float32), (linear.TILE_ROWS + 1, torch.bfloat16)):
            ran.clear()
            layer(torch.randn(rows, 192).to(dtype))
            native = tiles and way == "bfloat16" and dtype == torch.bfloat16 and rows <= linear.TILE_ROWS
            assert ran == ["native" if native else "dense"], (way, rows, dtype)


@pytest.mark.parametrize("flags", [("-mno-avx512f",), ("-mno-avx512f", "-mno-avx2", "-mno-fma", "-mno-f16c")],
                         ids=["avx2", "plain-c"])
def test_kernels_built_for_cpus_without_avx512_compute_the_same(tmp_path, monkeypatch, flags):
    """Built for CPUs without AVX-512 (the AVX2 loops) or without AVX2 and F16C too (plain C),
    the layers still compute with their dequantized weights, float32 rows and bfloat16 rows alike
    (the bfloat16 kernel declines there and the float32 one runs): mmkv's own layouts and a GGUF
    file's (two-level int4, int8 groups with offsets, int8 groups of 16)."""
    monkeypatch.setattr(native, "FLAGS", native.FLAGS + flags)
    monkeypatch.setenv("MMKV_NATIVE_CACHE", str(tmp_path))
    native.library.cache_clear()
    torch.manual_seed(0)
    weights = [quantize(torch.randn(37, 192), Quantization(method)) for method in METHODS]
    weights += [repack(kind, raw_blocks(kind, 37, 256), 37, 256) for kind in (T.Q4_K, T.Q5_1, T.Q6_K)]
    try:
        for quantized in weights:
            for rows in (1, 5):
                torch.manual_seed(rows)
                bias, x = torch.randn(37), torch.randn(rows, quantized.shape[1])
                layer = QuantizedLinear(quantized, bias)
                assert layer.kernels is not None
                weight = layer.weight.dequantize().double()
                expected = F.linear(x.double(), weight, bias.double())
                assert torch.allclose(layer.native(x).double(), expected, atol=1e-4 * expected.abs().max().item())
                expected = F.linear(x.bfloat16().double(), weight, bias.double())  # out in bfloat16
                assert torch.allclose(layer.native(x.bfloat16()).double(), expected, rtol=2 ** -7, atol=1e-3)
                assert torch.equal(layer.dequantized(), layer.weight.dequantize())
    finally:
        native.library.cache_clear()


def test_fused_layers_keep_one_copy_of_the_codes(model_dirs):
    eng = Engine(model_dirs["llama"], quantization="int4", kv_cache_memory="4MiB")
    layer = eng.model.fused[0]
    q_proj = eng.model.model.model.layers[0].self_attn.q_proj
    assert q_proj.weight.untyped_storage().data_ptr() == layer.qkv.weight.codes.untyped_storage().data_ptr()
    assert eng.stats()["weight_bytes"] == eng.model.weight_bytes


def test_an_idle_engine_hands_back_its_dequantization_buffers_and_free_heap(model_dirs, monkeypatch):
    """A prefill of more than ``NATIVE_ROWS`` rows dequantizes into the step thread's buffers; when
    the engine goes idle it drops them and trims the C heap (once per idle), and the next request
    makes them again and answers the same."""
    from mmkv import runner
    from mmkv.quantization import linear

    trims = []
    monkeypatch.setattr(runner, "release_free_heap", lambda **_: trims.append(True))
    eng = Engine(model_dirs["llama"], quantization="int4", kv_cache_memory="4MiB")
    made = []
    buffer = linear.dequantize_buffer
    monkeypatch.setattr(linear, "dequantize_buffer", lambda *a: made.append(a) or buffer(*a))
    first = eng.generate([PROMPTS[2]], P)[0].token_ids
    assert made and trims == [True]
    assert "by_dtype" not in linear._BUFFERS.__dict__
    assert eng.generate([PROMPTS[2]], P)[0].token_ids == first
    assert len(trims) == 2 and "by_dtype" not in linear._BUFFERS.__dict__


# -- each family against transformers on the dequantized weights ----------------------------------
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_text_models_match_transformers_on_the_dequantized_weights(model_dirs, family, method):
    eng = Engine(model_dirs[family], quantization=method, kv_cache_memory="4MiB", block_size=4,
                 debug=True)
    assert quantized_layers(eng) == 7 * eng.model.num_layers  # q k v o gate up down
    oracle = load_hf(model_dirs[family])
    whole = sum(p.nbytes for p in oracle.parameters())
    layers = sum(p.nbytes for p in oracle.model.layers.parameters())
    dequantized(oracle, method)
    for prompt, out in zip(PROMPTS, eng.generate(PROMPTS, P)):
        assert out.token_ids == hf_greedy(oracle, prompt, P.max_tokens), (family, method, len(prompt))
    ratio = {"int8": 0.28, "int4": 0.18}[method]  # of float32: codes, scales (offsets) and norms
    assert eng.model.weight_bytes - (whole - layers) < ratio * layers


def test_quantized_lm_head_and_draft_model(model_dirs, hf_oracle):
    """An int8 head; an int4 draft proposing for an unquantized target leaves the target's output
    exactly transformers'."""
    eng = Engine(model_dirs["llama"], quantization="int8", quantize_lm_head=True,
                 kv_cache_memory="4MiB")
    assert isinstance(eng.model.head, QuantizedLinear)
    oracle = dequantized(load_hf(model_dirs["llama"]), "int8")
    with torch.no_grad():
        oracle.lm_head.weight.copy_(quantize(oracle.lm_head.weight, Quantization("int8")).dequantize())
    assert eng.generate([PROMPTS[1]], P)[0].token_ids == hf_greedy(oracle, PROMPTS[1], P.max_tokens)
    spec = SpeculativeConfig(method="draft_model", draft_model=model_dirs["qwen2"], num_tokens=3,
                             draft_quantization="int4", settings=LEARNING)
    eng = Engine(model_dirs["llama"], speculative=spec, kv_cache_memory="8MiB", debug=True)
    outs = eng.generate(PROMPTS, P)
    for prompt, out in zip(PROMPTS, outs):
        hf_oracle.check("llama", prompt, out.token_ids)
    assert eng.stats()["spec_drafted_tokens"] > 0


def test_early_exit_and_compressed_kv_over_quantized_layers(model_dirs):
    """Speculation drafting through the quantized model's own first layer changes nothing."""
    method = "int4"
    oracle = dequantized(load_hf(model_dirs["llama"]), method)
    spec = SpeculativeConfig(method="early_exit", early_exit_layer=1, num_tokens=3, settings=LEARNING)
    eng = Engine(model_dirs["llama"], quantization=method, speculative=spec, kv_cache_memory="4MiB",
                 block_size=4, debug=True)
    for prompt, out in zip(PROMPTS, eng.generate(PROMPTS, P)):
        assert out.token_ids == hf_greedy(oracle, prompt, P.max_tokens)
    compressed = Engine(model_dirs["llama"], quantization=method, kv_cache_dtype="int8",
                        kv_cache_memory="4MiB")
    assert all(len(o.token_ids) == P.max_tokens for o in compressed.generate(PROMPTS, P))


def vlm_oracle(family: str, directory, method: str):
    if family == "mllama":
        return dequantized(MllamaForConditionalGeneration.from_pretrained(directory).eval(), method)
    if family == "llava":
        return dequantized(LlavaForConditionalGeneration.from_pretrained(directory).eval(), method)
    return dequantized(MmkvVLM.from_pretrained(directory), method)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("family", ["mllama", "llava", "mmkv_vlm"])
def test_vision_language_models_match_transformers_on_the_dequantized_weights(vlm_dirs, family, method):
    """Decoder layers (cross attention included) and the projector quantized, the tower not."""
    eng = Engine(vlm_dirs[family], quantization=method, kv_cache_memory="8MiB", block_size=4,
                 debug=True)
    names = [n for n, m in eng.model.model.named_modules() if isinstance(m, QuantizedLinearModule)]
    assert any("projector" in n for n in names) and not any("vision" in n for n in names)
    model = vlm_oracle(family, vlm_dirs[family], method)
    image = picture(1)
    prompts = [[IMAGE_TOKEN, *b"What is it?"], [*b"Hi ", IMAGE_TOKEN, *b"Colour?"]]
    outs = eng.generate([{"prompt": p, "images": [image]} for p in prompts], P)
    for prompt, out in zip(prompts, outs):
        if family == "mllama":
            processor = eng.model.vision.encoder.processor
            want = mllama_greedy(model, processor, prompt, [image], P.max_tokens)
        elif family == "llava":
            processor = eng.model.vision.encoder.processor
            want = llava_greedy(model, processor, prompt, image, P.max_tokens, eng.model.tokens_per_image)
        else:
            pixels = eng.model.vision.encoder.preprocess(image)["pixel_values"]
            want = mmkv_vlm_plain_greedy(model, pixels, prompt, P.max_tokens)
        assert out.token_ids == want, (family, method)


@pytest.mark.parametrize("method", METHODS)
def test_qwen2_5_vl_matches_transformers_on_the_dequantized_weights(tmp_path, method):
    directory = build_qwen_vl("qwen2_5_vl", tmp_path / "qwen2_5_vl")
    model, processor = load_oracle("qwen2_5_vl", directory)
    dequantized(model, method)
    eng = Engine(directory, quantization=method, kv_cache_memory="8MiB", block_size=4, debug=True)
    names = [n for n, m in eng.model.model.named_modules() if isinstance(m, QuantizedLinearModule)]
    assert any("merger" in n for n in names) and not any("blocks" in n for n in names)
    markup = "<|vision_start|><|image_pad|><|vision_end|>"
    requests = [(f"describe {markup} briefly", [qwen_picture(1)]), ("plain text, a few blocks long", [])]
    outs = eng.generate([{"prompt": t, "images": i} for t, i in requests], P)
    for (text, images), out in zip(requests, outs):
        prompt, answer = qwen_greedy(model, processor, text, images, P.max_tokens)
        assert out.prompt_token_ids == prompt and out.token_ids == answer, (text, method)


# -- composes with the rest of the engine ---------------------------------------------------------
@pytest.mark.parametrize("preemption", ["swap", "recompute"])
def test_preemption_and_resize_over_quantized_weights(model_dirs, preemption):
    """A pool too small for the batch preempts (swapping or recomputing), then shrinks and grows
    mid-run: outputs stay transformers' on the dequantized weights."""
    oracle = dequantized(load_hf(model_dirs["llama"]), "int4")
    per_block = 2 * 2 * 4 * 2 * 16 * 4  # layers x (K, V) x block x kv heads x head dim x fp32
    eng = Engine(model_dirs["llama"], quantization="int4", block_size=4, preemption=preemption,
                 kv_cache_memory=24 * per_block, host_kv_memory=1 << 20, debug=True)
    assert eng.kv.bytes_per_block == per_block
    prompts = [[(11 * i + j) % 250 for j in range(18)] for i in range(5)]
    ids = {eng.add_request(p, P): p for p in prompts}
    done, steps = {}, 0
    while eng.has_unfinished():
        done.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
        steps += 1
        if steps == 12:
            eng.resize_kv_cache(64 * per_block)
    assert done == {i: hf_greedy(oracle, p, P.max_tokens) for i, p in ids.items()}
    stats = eng.stats()
    assert stats[f"preemptions_{preemption}"] > 0 and stats["blocks_in_use"] == 0


def test_served_quantized_model_shares_images_and_reports_its_weight_bytes():
    """``mmkv serve --quantization int4`` on the bundled model: a second question about the same
    image reuses its cross-attention K/V, and ``/metrics`` reports the engine's weight bytes."""
    import argparse

    import httpx
    from openai import OpenAI

    from mmkv.cli import add_batch_arguments, add_serve_arguments
    from mmkv.engine_args import engine_options
    from server_harness import MODEL_NAME, png_data_url, scenes_and_reports, start_server

    batch = argparse.ArgumentParser()
    add_batch_arguments(batch)  # run-batch and its Ray replicas take the same engine options
    assert engine_options(batch.parse_args(["-i", "-", "-o", "-", "--quantization", "int8",
                                            "--quantize-lm-head"]))["quantize_lm_head"] is True
    serve = argparse.ArgumentParser()
    add_serve_arguments(serve)
    args = serve.parse_args(["--quantization", "int4", "--kv-cache-memory", "32MiB",
                             "--host-kv-memory", "4MiB"])
    options = engine_options(args)
    assert (options["quantization"], options["quantization_group_size"]) == ("int4", 32)
    running = start_server(Engine(args.model, **options))
    try:
        url = png_data_url(scenes_and_reports(3, 1, 0)[0][0].render())
        client = OpenAI(base_url=f"{running.url}/v1", api_key="none")
        for question in ("how many shapes?", "what colour is the circle?"):
            client.chat.completions.create(model=MODEL_NAME, max_tokens=3, temperature=0, messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": question}]}])
        assert httpx.get(f"{running.url}/v1/models").json()["data"][0]["quantization"] == "int4 (group 32)"
        stats = httpx.get(f"{running.url}/v1/stats").json()["replicas"]["0"]
        assert stats["xattn_blocks_reused"] > 0 and stats["encoder_calls"] == 1
        assert running.metrics()["mmkv_weight_bytes"] == stats["weight_bytes"] == running.engine.weight_bytes
        assert stats["weight_bytes"] < 0.6 * Engine(kv_cache_memory="4MiB").weight_bytes
    finally:
        running.stop()
