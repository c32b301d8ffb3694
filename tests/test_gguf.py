"""GGUF files load straight into mmkv's quantized layouts: every block type to exactly the weights
``gguf.quants.dequantize`` gives, and a whole file to the greedy output of transformers on the
same file (which dequantizes every tensor to float32: the oracle). Files come from the gguf
package's writer (``gguf_files``), and, where ``make bench-peers`` installed them, from llama.cpp's
own converter and quantizer."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T, GGUFWriter, quants
from gguf_files import mixed_kinds, raw_blocks, write_gguf
from tiny_models import build_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from mmkv import Engine, SamplingParams
from mmkv.models import ModelLoadError
from mmkv.quantization import Int4Weight, Int8GroupWeight, QuantizedLinear
from mmkv.quantization.gguf import QUANTIZED_TYPES, repack

SHAPE = dict(hidden_size=256, intermediate_size=512, vocab_size=320)  # K-quant rows are 256 weights
PROMPTS = ["hello wörld", "the quick brown fox"]


@pytest.mark.parametrize("kind", QUANTIZED_TYPES, ids=lambda k: k.name)
def test_each_block_type_repacks_to_the_weights_gguf_dequantizes(kind):
    rows, cols = 12, 512
    data = raw_blocks(kind, rows, cols)
    weight = repack(kind, data, rows, cols)
    expected = torch.from_numpy(quants.dequantize(data, kind))
    assert torch.equal(weight.dequantize(), expected)
    layer = QuantizedLinear(weight, None)
    for n in (1, 3, 17):  # native kernels, then the dense way
        x = torch.randn(n, cols)
        reference = F.linear(x, expected)  # sums of 512 products: float32 rounding in their order
        torch.testing.assert_close(layer(x), reference, rtol=0, atol=1e-5 * reference.abs().max().item())


@pytest.mark.parametrize("kind", [T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0], ids=lambda k: k.name)
@pytest.mark.parametrize("rows", [1, 5, 21])
def test_bfloat16_rows_meet_the_repacked_weight_in_bfloat16(kind, rows):
    """A bfloat16 model's rows go through the dot-product kernel or AMX tiles where the CPU has
    them: each weight is its dequantized value rounded to bfloat16 (groups of 16 and 32; two
    levels). 37 channels: two whole tile blocks and a partial one."""
    weight = repack(kind, raw_blocks(kind, 37, 512), 37, 512)
    layer = QuantizedLinear(weight, None)
    x = torch.randn(rows, 512).bfloat16()
    if layer.kernels is None or layer.run_kernel(layer.kernels[1], x) is None:
        pytest.skip("no AVX512-BF16 kernel on this CPU (the float32 kernel runs bfloat16 rows)")
    expected = F.linear(x.double(), weight.dequantize().bfloat16().double())
    got = layer.run_kernel(layer.kernels[1], x).double()
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5 * expected.abs().max().item())


def test_k_quant_scales_stay_in_two_levels_as_compact_as_the_file():
    rows, cols = 4, 1024
    q4k = repack(T.Q4_K, raw_blocks(T.Q4_K, rows, cols), rows, cols)
    assert isinstance(q4k, Int4Weight) and q4k.scale.dtype == torch.float16
    assert q4k.scale.shape == (rows, cols // 256) and q4k.scale_codes.shape == (rows, cols // 32)
    q6k = repack(T.Q6_K, raw_blocks(T.Q6_K, rows, cols), rows, cols)
    assert isinstance(q6k, Int8GroupWeight) and q6k.group_size == 16
    # a super-block of 256: Q4_K 128 code bytes, d and dmin, 8 + 8 sub-scale bytes (the file: 144);
    # Q6_K 256 code bytes (one a weight), d, 16 sub-scales (the file: 210, six bits a weight)
    assert q4k.nbytes == rows * cols // 256 * 148
    assert q6k.nbytes == rows * cols // 256 * 274


@pytest.fixture(scope="module")
def gguf_models(tmp_path_factory):
    """A Llama, a Mistral and a Qwen2 (tied embeddings), of every supported type, written with
    gguf. llama.cpp writes a Mistral as a Llama; transformers reads it as a Mistral when its name is
    "mistral" (and then cannot load its weights itself) and as a Llama otherwise, which computes
    the same within the sliding window. The Mistral file holds the Llama file's very tensors, so
    transformers on the Llama file is its oracle."""
    root = tmp_path_factory.mktemp("gguf")
    files = {}
    for family in ("llama", "qwen2"):
        source = build_model(family, root / f"hf-{family}", **SHAPE)
        files[family] = write_gguf(source, root / f"{family}.gguf", mixed_kinds)
    files["mistral"] = write_gguf(root / "hf-llama", root / "mistral.gguf", mixed_kinds, name="mistral")
    return files


def oracle(file):
    model = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)


def hf_greedy(model, prompt: list[int], new: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, min_new_tokens=new)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_a_gguf_file_runs_as_transformers_runs_it(gguf_models, family):
    file = gguf_models[family]
    model, tokenizer = oracle(gguf_models["llama" if family == "mistral" else family])
    engine = Engine(str(file), kv_cache_memory="32MiB")
    assert engine.model.text_config.model_type == family
    assert engine.quantization == "gguf"  # the writer names no file type
    layers = engine.model.text_model.layers[0].self_attn
    assert isinstance(layers.q_proj.quantized, Int4Weight)  # Q4_K
    assert isinstance(layers.v_proj.quantized, Int8GroupWeight)  # Q6_K
    outputs = engine.generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True))
    for prompt, output in zip(PROMPTS, outputs):
        ids = tokenizer.encode(prompt)
        assert engine.tokenizer.encode(prompt) == ids  # the tokenizer comes from the file
        assert list(output.token_ids) == hf_greedy(model, ids, 12)
    chat = [{"role": "user", "content": PROMPTS[0]}]  # and so does the chat template
    assert engine.render_chat(chat) == tokenizer.encode(f"<user>{PROMPTS[0]}\n<assistant>")


def test_a_directory_holding_one_gguf_file_loads_it(gguf_models, tmp_path):
    (tmp_path / "model.gguf").symlink_to(gguf_models["qwen2"])
    engine = Engine(str(tmp_path), kv_cache_memory="32MiB")
    assert engine.model.text_config.model_type == "qwen2"
    (tmp_path / "other.gguf").symlink_to(gguf_models["llama"])
    with pytest.raises(ModelLoadError, match="2 GGUF files"):
        Engine(str(tmp_path), kv_cache_memory="32MiB")


def test_serve_and_run_batch_take_a_gguf_file(gguf_models):
    """``mmkv serve model.gguf`` reports the file's quantization on /v1/models and answers text
    prompts with the file's tokenizer; ``mmkv run-batch`` on the same file answers the same."""
    import argparse

    import httpx
    from openai import OpenAI

    from mmkv.cli import add_serve_arguments
    from mmkv.engine_args import engine_options
    from mmkv.server.batch_file import run_batch
    from server_harness import MODEL_NAME, start_server

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args([str(gguf_models["llama"]), "--kv-cache-memory", "32MiB", "--host-kv-memory", "4MiB"])
    engine = Engine(args.model, **engine_options(args))
    expected = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=6, ignore_eos=True))[0].text
    running = start_server(engine)
    try:
        assert httpx.get(f"{running.url}/v1/models").json()["data"][0]["quantization"] == "gguf"
        client = OpenAI(base_url=f"{running.url}/v1", api_key="none")
        answer = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                           extra_body={"ignore_eos": True})
        assert answer.choices[0].text == expected
    finally:
        running.stop()
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions",
            "body": {"model": "m", "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "ignore_eos": True}}
    (result,) = run_batch(Engine(args.model, **engine_options(args)), [json.dumps(line)], progress=False)
    assert result["response"]["body"]["choices"][0]["text"] == expected


def write_raw(path, architecture: str, tensors: dict[str, tuple[T, np.ndarray]],
              fields: dict[str, int] | None = None):
    writer = GGUFWriter(str(path), architecture)
    for key, value in (fields or {}).items():
        writer.add_uint16(key, value)
    for name, (kind, data) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_what_mmkv_cannot_load_is_refused_by_name(gguf_models, tmp_path):
    q2k = write_raw(tmp_path / "q2k.gguf", "llama", {"blk.0.attn_q.weight": (T.Q2_K, raw_blocks(T.Q2_K, 4, 256))})
    with pytest.raises(ValueError, match="blk.0.attn_q.weight.*Q2_K"):
        Engine(str(q2k))
    iq = write_raw(tmp_path / "iq.gguf", "llama", {"token_embd.weight": (T.IQ4_NL, raw_blocks(T.Q4_0, 4, 256))})
    with pytest.raises(ValueError, match="IQ4_NL"):
        Engine(str(iq))
    gemma = write_raw(tmp_path / "gemma.gguf", "gemma", {})
    with pytest.raises(ValueError, match="architecture 'gemma'"):
        Engine(str(gemma))
    split = write_raw(tmp_path / "part.gguf", "llama", {}, {"split.count": 3})
    with pytest.raises(ValueError, match="split"):
        Engine(str(split))
    with pytest.raises(ValueError, match="quantized already"):
        Engine(str(gguf_models["llama"]), quantization="int4")
    with pytest.raises(ModelLoadError, match="does not exist"):
        Engine(str(tmp_path / "missing.gguf"))


# -- llama.cpp's own files (make bench-peers) -----------------------------------------------------

@pytest.fixture(scope="module")
def llama_cpp_files(tmp_path_factory):
    from mmkv.bench import llama_cpp_peer
    why = llama_cpp_peer.available()
    if why is not None:
        pytest.skip(why)
    root = tmp_path_factory.mktemp("llama_cpp")
    files = {}
    for family in ("llama", "qwen2"):
        source = build_model(family, root / f"hf-{family}", **SHAPE)
        f32 = llama_cpp_peer.convert(source, root / f"conv-{family}", ["f32"])["f32"]
        for kind in llama_cpp_peer.QUANT_KINDS:
            files[family, kind] = llama_cpp_peer.quantize(f32, root / f"{family}-{kind}.gguf", kind)
    return files


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "q4_k_m"])
def test_files_llama_cpp_quantized_match_transformers_and_agree_with_llama_cpp(llama_cpp_files, family, kind):
    from mmkv.bench.llama_cpp_peer import LlamaCpp
    file = llama_cpp_files[family, kind]
    model = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32).eval()
    prompts = [[5, 17, 99, 3, 250, 7], [300, 2, 2, 41]]
    engine = Engine(str(file), kv_cache_memory="32MiB")
    assert engine.quantization == f"gguf {kind.upper()}"
    ours = [list(o.token_ids) for o in engine.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))]
    assert ours == [hf_greedy(model, p, 16) for p in prompts]
    peer = LlamaCpp(file, num_seqs=len(prompts), max_len=64)
    try:
        theirs = peer.generate(prompts, 16)
    finally:
        peer.close()
    same = sum(a == b for o, t in zip(ours, theirs) for a, b in zip(o, t))
    print(f"\n{family} {kind}: greedy tokens equal to llama.cpp's: {same}/{sum(map(len, ours))}")
