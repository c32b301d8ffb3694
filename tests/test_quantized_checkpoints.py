"""Hugging Face checkpoints quantized by AWQ, GPTQ and compressed-tensors load into mmkv's layouts:
each layer to exactly the dequantized weight ``(q - z) s`` of the codes the checkpoint was written
from, and greedy output equal to transformers on the model with those weights. The AWQ and GPTQ
checkpoints are written by the test in each format's documented layout, compressed-tensors ones by
the ``compressed_tensors`` library (``quantized_checkpoints``)."""

from __future__ import annotations

import json

import pytest
import torch
from quantized_checkpoints import compressed_tensors_checkpoint, dequantized_model, quantize_checkpoint
from tiny_models import build_model, hf_greedy
from tiny_qwen_vl import build_qwen_vl, hf_greedy as qwen_greedy, load_oracle, picture as qwen_picture
from transformers import AutoModelForCausalLM

from mmkv import Engine, SamplingParams
from mmkv.quantization import Int4Weight, Int8GroupWeight, QuantizedLinearModule

PROMPTS = [[5, 17, 99, 3, 250, 7], [300 % 256, 2, 2, 41]]
CASES = {  # name: (writer, its options, the layout mmkv runs it in, what engine.quantization says)
    "awq": (quantize_checkpoint, dict(method="awq"), Int4Weight, "awq int4 (group 32)"),
    "gptq": (quantize_checkpoint, dict(method="gptq"), Int4Weight, "gptq int4 (group 32)"),
    "gptq_symmetric": (quantize_checkpoint, dict(method="gptq", symmetric=True), Int4Weight, "gptq int4 (group 32)"),
    "gptq_v2": (quantize_checkpoint, dict(method="gptq", gptq_format="gptq_v2"), Int4Weight, "gptq int4 (group 32)"),
    "gptq_int8": (quantize_checkpoint, dict(method="gptq", bits=8), Int8GroupWeight, "gptq int8 (group 32)"),
    "compressed_tensors_w4a16": (compressed_tensors_checkpoint, dict(), Int4Weight,
                                 "compressed-tensors int4 (group 32)"),
    "compressed_tensors_w8a16_asymmetric": (compressed_tensors_checkpoint, dict(bits=8, symmetric=False),
                                            Int8GroupWeight, "compressed-tensors int8 (group 32)"),
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    return {family: build_model(family, root / family) for family in ("llama", "qwen2")}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_quantized_checkpoint_loads_to_its_dequantized_weights_and_runs_as_transformers(
        sources, tmp_path, family, case):
    write, options, layout, described = CASES[case]
    weights = write(sources[family], tmp_path / case, **options)
    engine = Engine(str(tmp_path / case), kv_cache_memory="16MiB")
    assert engine.quantization == described
    modules = dict(engine.model.model.named_modules())
    for key, expected in weights.items():
        module = modules[key.removesuffix(".weight")]
        assert isinstance(module, QuantizedLinearModule) and isinstance(module.quantized, layout)
        assert torch.equal(module.quantized.dequantize(), expected), key
    oracle = dequantized_model(AutoModelForCausalLM, sources[family], weights)
    outputs = engine.generate(PROMPTS, SamplingParams(max_tokens=10, ignore_eos=True))
    assert [list(o.token_ids) for o in outputs] == [hf_greedy(oracle, p, 10) for p in PROMPTS]


def test_qwen2_5_vl_awq_runs_as_transformers_with_its_vision_tower_as_stored(tmp_path):
    source = build_qwen_vl("qwen2_5_vl", tmp_path / "source")
    weights = quantize_checkpoint(source, tmp_path / "awq", "awq")
    engine = Engine(str(tmp_path / "awq"), kv_cache_memory="8MiB", block_size=4)
    assert engine.quantization == "awq int4 (group 32)"
    names = [n for n, m in engine.model.model.named_modules() if isinstance(m, QuantizedLinearModule)]
    assert len(names) == len(weights) and not any("visual" in n for n in names)  # modules_to_not_convert
    model, processor = load_oracle("qwen2_5_vl", source)
    modules = dict(model.named_modules())
    for key, weight in weights.items():  # the checkpoint's names are the loaded model's
        modules[next(n for n in modules if n.endswith(key.removesuffix(".weight").removeprefix("model."))
                      and "visual" not in n)].weight.data = weight.clone()
    markup = "<|vision_start|><|image_pad|><|vision_end|>"
    requests = [(f"describe {markup} briefly", [qwen_picture(1)]), ("plain text, a few blocks long", [])]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    outputs = engine.generate([{"prompt": t, "images": i} for t, i in requests], params)
    for (text, images), output in zip(requests, outputs):
        prompt, answer = qwen_greedy(model, processor, text, images, params.max_tokens)
        assert output.prompt_token_ids == prompt and output.token_ids == answer, text


def set_quantization_config(directory, **changes):
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"].update(changes)
    (directory / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("changes, message", [
    (dict(desc_act=True), "desc_act"),
    (dict(bits=3), "3 bits"),
    (dict(checkpoint_format="marlin"), "checkpoint_format 'marlin'"),
    (dict(quant_method="bitsandbytes"), "'bitsandbytes' is not supported"),
])
def test_an_option_mmkv_does_not_run_is_refused_by_name(sources, tmp_path, changes, message):
    quantize_checkpoint(sources["llama"], tmp_path / "gptq", "gptq")
    set_quantization_config(tmp_path / "gptq", **changes)
    with pytest.raises(ValueError, match=message):
        Engine(str(tmp_path / "gptq"), kv_cache_memory="16MiB")


def test_act_order_groups_are_refused_even_when_the_config_does_not_say_so(sources, tmp_path):
    quantize_checkpoint(sources["llama"], tmp_path / "gptq", "gptq", act_order=True)
    set_quantization_config(tmp_path / "gptq", desc_act=False)
    with pytest.raises(ValueError, match="g_idx"):
        Engine(str(tmp_path / "gptq"), kv_cache_memory="16MiB")


def test_awq_gemv_and_quantizing_again_are_refused(sources, tmp_path):
    quantize_checkpoint(sources["llama"], tmp_path / "awq", "awq")
    with pytest.raises(ValueError, match="quantized already"):
        Engine(str(tmp_path / "awq"), quantization="int4")
    set_quantization_config(tmp_path / "awq", version="gemv")
    with pytest.raises(ValueError, match="AWQ version 'gemv'"):
        Engine(str(tmp_path / "awq"))
