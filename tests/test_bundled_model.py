"""The committed model answers held-out questions; the training script runs end to end."""

import json
import runpy
import sys
from pathlib import Path

import pytest
import torch

from mmkv import Engine, SamplingParams
from mmkv.bundled import BUNDLED_MODEL
from mmkv.eval import evaluate
from mmkv.models.base import read_config_json

ROOT = Path(__file__).parent.parent


@pytest.fixture
def example(monkeypatch, capsys):
    """Runs ``python examples/<name> <args>`` in this process, as ``__main__``, and returns what it
    printed (a process of its own would first spend ~13 s importing torch and transformers).
    torch's thread count, which a script may set, is put back after."""
    def run(name: str, *args: str) -> str:
        monkeypatch.setattr(sys, "argv", [name, *args])
        monkeypatch.syspath_prepend(str(ROOT / "examples"))  # as `python examples/<name>` puts it first
        threads = torch.get_num_threads()
        try:
            runpy.run_path(str(ROOT / "examples" / name), run_name="__main__")
        finally:
            torch.set_num_threads(threads)
        return capsys.readouterr().out
    return run


def test_bundled_model_is_small_and_loads_by_default():
    size = sum(f.stat().st_size for f in BUNDLED_MODEL.iterdir())
    assert size <= 30 * 2**20
    engine = Engine(kv_cache_memory="64MiB", host_kv_memory="8MiB")
    assert engine.model.vision is not None and engine.tokenizer is not None


def test_bundled_model_reaches_its_accuracy_identically_with_caching_and_speculation():
    """50 held-out scene and 50 document questions (a seed neither training nor the README's eval
    uses), answered with prefix caching on and off and with early-exit speculation."""
    result = evaluate(BUNDLED_MODEL, scenes=50, documents=50, seed=123)
    assert result["identical_with_and_without_caching"] and result["identical_with_speculation"]
    assert result["scene_accuracy"] >= 0.9, result
    assert result["document_accuracy"] >= 0.9, result


@pytest.mark.parametrize("options", [{"dtype": "bfloat16"}, {"kv_cache_dtype": "int8"},
                                     {"kv_cache_dtype": "fp8_e4m3"}, {"quantization": "int8"},
                                     {"quantization": "int4"}],
                         ids=["bf16", "int8-kv", "fp8-kv", "int8-weights", "int4-weights"])
def test_bundled_model_answers_the_same_in_bfloat16_compressed_and_quantized(options):
    """The fast mode, compressed KV caches and quantized weights on the trained model: held-out
    answers (30 scene and 30 document questions) agree with float32's over an uncompressed cache,
    and the accuracy stays within one question of it."""
    result = evaluate(BUNDLED_MODEL, scenes=30, documents=30, seed=321, **options)
    assert result["answers_equal_reference"] >= 0.95, result
    assert result["identical_with_and_without_caching"], result
    for task in ("scene", "document"):
        assert result[f"{task}_accuracy"] >= result[f"reference_{task}_accuracy"] - 1 / 30, result


def test_training_script_smoke(tmp_path, example):
    example("train_tiny.py", "--out", str(tmp_path), "--smoke")
    assert (tmp_path / "loss.png").stat().st_size > 0
    engine = Engine(tmp_path / "tiny-vlm", kv_cache_memory="32MiB", host_kv_memory="4MiB")
    out = engine.ask(tmp_path / "loss.png", ["what is it?"],
                     SamplingParams(max_tokens=3))[0]
    assert len(out.token_ids) >= 1
    draft = Engine(tmp_path / "tiny-draft", kv_cache_memory="32MiB", host_kv_memory="4MiB")
    assert len(draft.generate("hello", SamplingParams(max_tokens=2))[0].token_ids) >= 1
    vlm_weights = (tmp_path / "tiny-vlm" / "model.safetensors").read_bytes()
    example("train_tiny.py", "--out", str(tmp_path), "--smoke", "--draft-only", "--draft-steps", "3")
    assert (tmp_path / "tiny-vlm" / "model.safetensors").read_bytes() == vlm_weights  # untouched
    assert json.loads((tmp_path / "training.json").read_text())["draft"]["retrained_alone"]
    assert (tmp_path / "draft_loss.png").stat().st_size > 0
    draft = Engine(tmp_path / "tiny-draft", kv_cache_memory="32MiB", host_kv_memory="4MiB")
    assert len(draft.generate("hello", SamplingParams(max_tokens=2))[0].token_ids) >= 1


def test_cross_attention_inspector_runs_on_the_bundled_model(example):
    out = example("inspect_cross_attention.py", "--cells", "top left,centre")
    rows = [line for line in out.splitlines() if line.strip().startswith("layer ")]
    heads = read_config_json(BUNDLED_MODEL)["text_config"]["num_attention_heads"]
    assert len(rows) == 2 * heads  # two questions
    for row in rows:  # each head's weights over the nine patches form a distribution
        weights = [float(w) for w in row.split(":")[1].split()]
        assert len(weights) == 9 and abs(sum(weights) - 1) <= 9 * 0.005  # printed to 2 decimals


def test_bundled_chat_template_renders_the_training_prompts():
    """A user turn with an image and a question is the scene prompt; a system turn (a report) and
    a user turn are the document prompt; a follow-up after an answer is the packed training form."""
    import random

    from mmkv.synthetic import document_prompt, random_report, scene_prompt

    engine = Engine(kv_cache_memory="16MiB", host_kv_memory="1MiB")
    encode = engine.tokenizer.encode
    question = "what colour is the circle?"
    assert engine.render_chat([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": question}]}]) == encode(scene_prompt(question))
    report = random_report(random.Random(3))
    asked = [{"role": "system", "content": report.text},
             {"role": "user", "content": "summarise the report."}]
    assert engine.render_chat(asked) == encode(document_prompt(report, "summarise the report."))
    follow_up = asked + [{"role": "assistant", "content": " mayor anna berg"},
                         {"role": "user", "content": [{"type": "text", "text": "who is the mayor?"}]}]
    assert engine.render_chat(follow_up) == encode(
        document_prompt(report, "summarise the report.") + " mayor anna berg<eos>"
        "\ninstruction: who is the mayor?\nanswer:")
    with pytest.raises(ValueError, match="roles are system, developer, user or assistant, got tool"):
        engine.render_chat([{"role": "tool", "content": "x"}])


def test_demo_counts_only_the_batched_call(tmp_path, example):
    """`make demo`'s script: its counts are those of the batched call (the untimed warm-up left
    out): one encoder pass per image with sharing, one per question without."""
    out = example("image_qa.py", "--rounds", "1", "--out", str(tmp_path / "qa.png"))
    assert "encoder calls: 6 for 6 images and 48 questions (without sharing: 48)" in out, out
    assert "cross-attention K/V blocks computed: 6 (without sharing: 48)" in out, out
    right = int(out.split("/48 answers exactly right")[0].split()[-1])
    assert right >= 44, out
    assert (tmp_path / "qa.png").exists()
    assert "median of 1 alternating runs, each the batch" in out, out
