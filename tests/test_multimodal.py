"""Vision-language models: outputs against transformers, sharing of encoder work and image K/V."""

import pytest
import torch
from transformers import AutoImageProcessor, LlavaForConditionalGeneration, MllamaForConditionalGeneration

from mmkv import Engine, SamplingParams
from mmkv.models import MmkvVLM
from speculative import SpeculativeConfig
from tiny_models import LEARNING
from tiny_vlms import (IMAGE_TOKEN, llava_greedy, mllama_greedy, mmkv_vlm_plain_greedy, picture)
from vision import ImageError

P = SamplingParams(max_tokens=10, ignore_eos=True)
BLOCK_BYTES = {"mllama": 2 * 2 * 4 * 2 * 16 * 4, "llava": 2 * 2 * 4 * 2 * 16 * 4,
               "mmkv_vlm": 2 * 2 * 4 * 2 * 16 * 4}  # slots x (K, V) x block x kv heads x head dim


def vlm_engine(vlm_dirs, family, blocks=1024, **kw) -> Engine:
    kw.setdefault("debug", True)
    return Engine(vlm_dirs[family], kv_cache_memory=blocks * BLOCK_BYTES[family],
                  host_kv_memory=blocks * BLOCK_BYTES[family], block_size=4, device="cpu", **kw)


def q(text: str, before: str = "") -> list[int]:
    return list(before.encode()) + [IMAGE_TOKEN] + list(text.encode())


@pytest.fixture(scope="module")
def hf_models(vlm_dirs):
    return {"mllama": (MllamaForConditionalGeneration.from_pretrained(vlm_dirs["mllama"]).eval(),
                       AutoImageProcessor.from_pretrained(vlm_dirs["mllama"])),
            "llava": (LlavaForConditionalGeneration.from_pretrained(vlm_dirs["llava"]).eval(),
                      AutoImageProcessor.from_pretrained(vlm_dirs["llava"])),
            "mmkv_vlm": MmkvVLM.from_pretrained(vlm_dirs["mmkv_vlm"])}


def oracle(family, hf_models, eng, prompt, images):
    if family == "mllama":
        return mllama_greedy(*hf_models["mllama"], prompt, images, P.max_tokens)
    if family == "llava":
        return llava_greedy(*hf_models["llava"], prompt, images[0], P.max_tokens,
                            eng.model.tokens_per_image)
    pixels = eng.model.vision.encoder.preprocess(images[0])["pixel_values"]
    return mmkv_vlm_plain_greedy(hf_models["mmkv_vlm"], pixels, prompt, P.max_tokens)


@pytest.mark.parametrize("family", ["mllama", "llava", "mmkv_vlm"])
def test_batched_questions_match_the_reference(vlm_dirs, hf_models, family):
    eng = vlm_engine(vlm_dirs, family)
    images = [picture(1), picture(2, size=(30, 50))]
    prompts = [q("What is it?"), q("Colour?"), q("How many?", before="Hi "), q("Where is it now?")]
    requests = [{"prompt": p, "images": [img]} for img in images for p in prompts]
    outs = eng.generate(requests, P)
    for req, out in zip(requests, outs):
        assert out.token_ids == oracle(family, hf_models, eng, req["prompt"], req["images"])
    alone = eng.generate([requests[5]], P)[0]  # same answer served alone, from the cache
    assert alone.token_ids == outs[5].token_ids
    stats = eng.stats()
    assert stats["encoder_calls"] == 2 and stats["blocks_in_use"] == 0


@pytest.mark.parametrize("family", ["mllama", "llava", "mmkv_vlm"])
def test_one_encoder_call_and_one_copy_of_image_kv_per_image(vlm_dirs, family):
    eng = vlm_engine(vlm_dirs, family)
    img = picture(3)
    questions = [f"question number {i}?" for i in range(6)]
    outs = eng.ask(img, questions, P)
    assert len(outs) == 6 and eng.stats()["encoder_calls"] == 1
    if family == "llava":  # image tokens are in the sequence: later questions reuse their KV
        assert all(o.cached_tokens >= eng.model.tokens_per_image for o in outs[1:])
    else:
        per_image = -(-eng.model.placement(eng.model.vision.prepare([img])[0]).xattn_tokens // 4)
        assert eng.stats()["xattn_blocks_computed"] == per_image
    other = eng.ask([picture(4)], questions[:2], P)[0]
    assert eng.stats()["encoder_calls"] == 2
    assert [o.token_ids for o in other] != [o.token_ids for o in outs[:2]]
    if family != "llava":
        assert eng.stats()["xattn_blocks_computed"] == 2 * per_image


def test_image_kv_blocks_are_shared_while_questions_run(vlm_dirs):
    eng = vlm_engine(vlm_dirs, "mmkv_vlm")
    img = picture(5)
    for i in range(4):
        eng.add_request({"prompt": q(f"q{i}"), "images": [img]}, P)
    eng.step()
    running = eng.scheduler.running
    assert len(running) == 4
    tables = {tuple(t.blocks) for s in running for t in s.image_tables}
    assert len(tables) == 1  # every question holds the same image blocks
    [blocks] = tables
    assert all(eng.kv.pool.refcount[b] == 4 for b in blocks)
    while eng.has_unfinished():
        eng.step()


@pytest.mark.parametrize("family", ["mllama", "mmkv_vlm", "llava"])
def test_forced_image_key_collision_changes_nothing(vlm_dirs, family):
    images = [picture(6), picture(7)]
    requests = [{"prompt": q(t), "images": [img]} for img in images for t in ("a?", "b?")]
    honest = vlm_engine(vlm_dirs, family).generate(requests, P)
    colliding = vlm_engine(vlm_dirs, family)
    colliding.model.vision.registry._key_fn = lambda inputs, identity: b"\x00" * 16
    forced = colliding.generate(requests, P)
    assert [o.token_ids for o in forced] == [o.token_ids for o in honest]
    assert colliding.stats()["distinct_images"] == 2


def test_mllama_multi_image_and_text_only_requests(vlm_dirs, hf_models):
    eng = vlm_engine(vlm_dirs, "mllama")
    a, b = picture(8), picture(9, size=(60, 20))
    two = list(b"<") + [IMAGE_TOKEN] + list(b"x") + [IMAGE_TOKEN] + list(b"compare?")
    adjacent = [IMAGE_TOKEN, IMAGE_TOKEN] + list(b"both?")
    text = list(b"plain text prompt")
    outs = eng.generate([{"prompt": two, "images": [a, b]}, {"prompt": adjacent, "images": [b, a]},
                         text], P)
    model, processor = hf_models["mllama"]
    assert outs[0].token_ids == mllama_greedy(model, processor, two, [a, b], P.max_tokens)
    assert outs[1].token_ids == mllama_greedy(model, processor, adjacent, [b, a], P.max_tokens)
    assert outs[2].token_ids == mllama_greedy(model, processor, text, [], P.max_tokens)


@pytest.mark.parametrize("family", ["mllama", "llava", "mmkv_vlm"])
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_images_under_memory_pressure(vlm_dirs, hf_models, family, mode):
    images = [picture(10 + i) for i in range(4)]
    requests = [{"prompt": q(f"question {j} about it?"), "images": [img]}
                for j in range(3) for img in images]
    eng = vlm_engine(vlm_dirs, family, blocks=40, max_num_batched_tokens=48, preemption=mode)
    got = eng.generate(requests, P)
    for req, out in zip(requests, got):
        assert out.token_ids == oracle(family, hf_models, eng, req["prompt"], req["images"])
    stats = eng.stats()
    assert stats["evictions"] > 0 and stats["blocks_in_use"] == 0
    assert stats[f"preemptions_{mode}"] > 0


@pytest.mark.parametrize("family, k", [("mllama", 2), ("llava", 1), ("mmkv_vlm", 3)])
@pytest.mark.parametrize("budget", [2048, 5])  # 5: chunked prefill, splitting LLaVA's image tokens
def test_early_exit_speculation_matches_the_reference(vlm_dirs, hf_models, family, k, budget):
    """Drafting through the first k layers (Mllama's and mmkv_vlm's include a cross-attention
    layer) gives transformers' greedy tokens, images shared across questions."""
    images = [picture(40), picture(41, size=(30, 50))]
    prompts = [q("What is it?"), q("Colour?", before="Hi "), q("Where is it now?")]
    requests = [{"prompt": p, "images": [img]} for img in images for p in prompts] + [
        list(b"text only")]
    eng = vlm_engine(vlm_dirs, family, max_num_batched_tokens=budget,
                     speculative=SpeculativeConfig(num_tokens=3, early_exit_layer=k,
                                                       settings=LEARNING))
    outs = eng.generate(requests, P)
    for req, out in zip(requests[:-1], outs):
        assert out.token_ids == oracle(family, hf_models, eng, req["prompt"], req["images"])
    if family == "mllama":
        assert outs[-1].token_ids == mllama_greedy(*hf_models["mllama"], requests[-1], [], P.max_tokens)
    stats = eng.stats()
    assert stats["spec_rounds"] > 0 and stats["encoder_calls"] == 2 and stats["blocks_in_use"] == 0


def test_string_prompts_and_ask_many_images(vlm_dirs, hf_models):
    eng = vlm_engine(vlm_dirs, "mmkv_vlm")
    images = [picture(20), picture(21)]
    answers = eng.ask(images, ["colour?", "size?"], P)
    assert [len(a) for a in answers] == [2, 2]
    direct = eng.generate({"prompt": "<image>Q:size?\nA:", "images": [images[1]]}, P)[0]
    assert direct.token_ids == answers[1][1].token_ids
    prompt = eng.tokenizer.encode("<image>Q:size?\nA:")
    assert prompt.count(IMAGE_TOKEN) == 1
    assert direct.token_ids == oracle("mmkv_vlm", hf_models, eng, prompt, [images[1]])


def test_bad_images_fail_alone(vlm_dirs, tmp_path):
    eng = vlm_engine(vlm_dirs, "mllama")
    good = {"prompt": q("ok?"), "images": [picture(30)]}
    bad = {"prompt": q("broken?"), "images": [b"\x89PNG\r\n\x1a\n corrupt"]}
    with pytest.raises(ImageError, match="request 1 image 0: cannot be decoded"):
        eng.generate([good, bad], P)
    assert not eng.has_unfinished()
    outs = eng.generate([good, bad, {"prompt": q("x"), "images": [tmp_path / "missing.png"]}], P,
                        errors="return")
    assert outs[0].error is None and len(outs[0].token_ids) == P.max_tokens
    assert "cannot be decoded" in outs[1].error and "does not exist" in outs[2].error
    with pytest.raises(ValueError, match="2 image placeholders but 1 images"):
        eng.generate({"prompt": q("x") + [IMAGE_TOKEN], "images": [picture(1)]}, P)
    assert eng.stats()["blocks_in_use"] == 0


def test_text_models_refuse_images(model_dirs):
    eng = Engine(model_dirs["llama"], device="cpu", kv_cache_memory="1MiB", host_kv_memory="1MiB")
    with pytest.raises(ValueError, match="does not take images"):
        eng.generate({"prompt": [1, 2], "images": [picture(1)]}, P)
    assert eng.stats()["blocks_in_use"] == 0
