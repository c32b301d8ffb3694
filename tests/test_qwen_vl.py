"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL (M-RoPE) against transformers' generate: batches, chunked
prefill through images, image-keyed prefix sharing, preemption, speculation, grid collisions."""

import httpx
import pytest
import torch
from PIL import Image

from mmkv import Engine, SamplingParams
from server_harness import MODEL_NAME, png_data_url, start_server
from test_fused_layer import assert_same_as_modules
from speculative import SpeculativeConfig
from tiny_models import LEARNING
from tiny_qwen_vl import FAMILIES, IMAGE_PAD, build_qwen_vl, hf_greedy, load_oracle, picture

P = SamplingParams(max_tokens=12, ignore_eos=True)
BLOCK_BYTES = 3 * 2 * 4 * 2 * 16 * 4  # layers x (K, V) x block x kv heads x head dim x fp32
MARKUP = "<|vision_start|><|image_pad|><|vision_end|>"
WIDE, TALL = picture(1, (84, 56)), picture(2, (56, 112))
REQUESTS = [  # (processor text, images): a wide image, a tall one, two in one prompt, text only
    (f"describe {MARKUP} briefly", [WIDE]),
    (f"{MARKUP}what is at the top?", [TALL]),
    (f"compare {MARKUP} with {MARKUP}: which is brighter?", [TALL, WIDE]),
    ("a prompt of plain text, long enough to cross several blocks", []),
]


@pytest.fixture(scope="module")
def qwen_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen_vl")
    return {family: build_qwen_vl(family, root / family) for family in FAMILIES}


@pytest.fixture(scope="module")
def oracle(qwen_dirs):
    """``(family, text, images) -> (prompt ids, greedy answer)`` by transformers, memoised."""
    loaded, memo = {}, {}

    def answer(family: str, text: str, images: list[Image.Image]) -> tuple[list[int], list[int]]:
        key = (family, text, tuple((i.size, i.tobytes()) for i in images))
        if key not in memo:
            if family not in loaded:
                loaded[family] = load_oracle(family, qwen_dirs[family])
            memo[key] = hf_greedy(*loaded[family], text, images, P.max_tokens)
        return memo[key]

    return answer


def qwen_engine(qwen_dirs, family, blocks=512, **kw) -> Engine:
    kw.setdefault("debug", True)
    return Engine(qwen_dirs[family], kv_cache_memory=blocks * BLOCK_BYTES,
                  host_kv_memory=blocks * BLOCK_BYTES, block_size=4, device="cpu", **kw)


def run(eng: Engine, requests, params: SamplingParams = P, **kw):
    return eng.generate([{"prompt": text, "images": images} for text, images in requests], params,
                        **kw)


def assert_oracle(family, oracle, requests, outs):
    for (text, images), out in zip(requests, outs):
        prompt, answer = oracle(family, text, images)
        assert out.prompt_token_ids == prompt, text
        assert out.token_ids == answer, text


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_batch_matches_transformers(qwen_dirs, oracle, family):
    eng = qwen_engine(qwen_dirs, family)
    assert_oracle(family, oracle, REQUESTS, run(eng, REQUESTS))
    stats = eng.stats()
    assert stats["encoder_calls"] == 2 and stats["blocks_in_use"] == 0


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_chunked_prefill_splits_images(qwen_dirs, oracle, family):
    """Chunks of 5 tokens cut through every image; each chunk reads its slice of the positions
    (and of the image and deepstack features)."""
    eng = qwen_engine(qwen_dirs, family, max_num_batched_tokens=5)
    requests = REQUESTS[:3]
    assert_oracle(family, oracle, requests, run(eng, requests))


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_text_before_a_different_image_is_shared_but_not_the_image(qwen_dirs, oracle, family):
    eng = qwen_engine(qwen_dirs, family)
    shared = "a long shared instruction before the picture "
    first, second = ((shared + MARKUP + " what is it?", [img]) for img in (WIDE, picture(3)))
    [a] = run(eng, [first])
    [b] = run(eng, [second])
    start = b.prompt_token_ids.index(IMAGE_PAD)
    assert a.cached_tokens == 0 and b.cached_tokens == start
    assert_oracle(family, oracle, [first, second], [a, b])
    assert a.token_ids != b.token_ids


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_many_questions_about_one_image_share_it(qwen_dirs, oracle, family):
    eng = qwen_engine(qwen_dirs, family)
    questions = ["what colour?", "how many?", "where is the cat?", "is it night?", "why?"]
    outs = eng.ask(TALL, questions, P)
    processor = load_oracle(family, qwen_dirs[family])[1]
    texts = [processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}],
        add_generation_prompt=True, tokenize=False) for q in questions]
    assert_oracle(family, oracle, [(t, [TALL]) for t in texts], outs)
    end = outs[0].prompt_token_ids.index(IMAGE_PAD) + outs[0].prompt_token_ids.count(IMAGE_PAD)
    assert all(o.cached_tokens > end for o in outs[1:])  # the image and <|vision_end|>
    assert eng.stats()["encoder_calls"] == 1
    again = eng.ask(TALL, questions[:1], P)[0]
    assert again.token_ids == outs[0].token_ids and eng.stats()["encoder_calls"] == 1


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_solid_84x56_and_56x84_images_are_different_images(qwen_dirs, oracle, family):
    """Same pixel values, same prompt ids, different grids: different keys and outputs (every
    image token has the same features, so only the grid's positions tell them apart: the greedy
    tokens may agree, their log-probabilities do not)."""
    wide, tall = Image.new("RGB", (84, 56), (200, 40, 90)), Image.new("RGB", (56, 84), (200, 40, 90))
    eng = qwen_engine(qwen_dirs, family)
    requests = [(f"{MARKUP}describe", [wide]), (f"{MARKUP}describe", [tall])]
    inputs = [eng.model.vision.prepare(images)[0].inputs for _, images in requests]
    assert torch.equal(inputs[0]["pixel_values"], inputs[1]["pixel_values"])
    with_logprobs = SamplingParams(max_tokens=P.max_tokens, ignore_eos=True, logprobs=0)
    [a] = run(eng, requests[:1], with_logprobs)
    [b] = run(eng, requests[1:], with_logprobs)
    assert a.prompt_token_ids == b.prompt_token_ids
    assert a.outputs[0].logprobs[0].logprob != b.outputs[0].logprobs[0].logprob
    assert b.cached_tokens == b.prompt_token_ids.index(IMAGE_PAD)
    assert eng.stats()["distinct_images"] == 2 and eng.stats()["encoder_calls"] == 2
    assert_oracle(family, oracle, requests, [a, b])


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_preemption(qwen_dirs, oracle, family, mode):
    eng = qwen_engine(qwen_dirs, family, blocks=22, preemption=mode, max_num_batched_tokens=16)
    requests = REQUESTS[:3] * 2
    outs = run(eng, requests)
    assert_oracle(family, oracle, requests, outs)
    stats = eng.stats()
    assert stats[f"preemptions_{mode}"] > 0 and stats["blocks_in_use"] == 0


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_early_exit_speculation(tmp_path, family):
    """Drafts from layer 1 (the upper layers are quiet, so many are accepted): the accepted
    drafts' lower-layer K/V were written at the positions the draft passes gave them."""
    directory = build_qwen_vl(family, tmp_path / family, quiet_from=1)
    eng = qwen_engine({family: directory}, family,
                      speculative=SpeculativeConfig(num_tokens=3, early_exit_layer=1, settings=LEARNING))
    outs = run(eng, REQUESTS)
    model, processor = load_oracle(family, directory)
    for (text, images), out in zip(REQUESTS, outs):
        assert out.token_ids == hf_greedy(model, processor, text, images, P.max_tokens)[1]
    stats = eng.stats()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_drafted_tokens"]


def test_image_placeholder_chat_template_and_processor_text(qwen_dirs, oracle):
    """``<image>`` with and without the chat template, and the text the processor's own chat
    template writes, all as transformers reads them."""
    eng = qwen_engine(qwen_dirs, "qwen2_5_vl")
    [plain, chat] = [eng.generate({"prompt": "<image>what is it?", "images": [WIDE]}, P, chat=c)[0]
                     for c in (False, True)]
    processor = load_oracle("qwen2_5_vl", qwen_dirs["qwen2_5_vl"])[1]
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]}],
        add_generation_prompt=True, tokenize=False)
    [direct] = run(eng, [(text, [WIDE])])
    assert_oracle("qwen2_5_vl", oracle, [(MARKUP + "what is it?", [WIDE]), (text, [WIDE]),
                                         (text, [WIDE])], [plain, chat, direct])


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_rotary_reads_the_modules_own_values_for_3d_positions(qwen_dirs, family):
    model = qwen_engine(qwen_dirs, family).model
    hidden = torch.zeros(1, 1, model.text_config.hidden_size)
    positions = torch.randint(0, 300, (3, 40), generator=torch.Generator().manual_seed(0))
    got = model.rotary(hidden, positions, 300)
    want = model.text_model.rotary_emb(hidden, position_ids=positions[:, None])
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_bad_image_prompts_fail_alone(qwen_dirs):
    eng = qwen_engine(qwen_dirs, "qwen2_vl")
    with pytest.raises(ValueError, match="request 1: two images are adjacent"):
        eng.generate([{"prompt": MARKUP, "images": [WIDE]},
                      {"prompt": [1, IMAGE_PAD, IMAGE_PAD, 2], "images": [WIDE, TALL]}], P)
    with pytest.raises(ValueError, match="1 image placeholders but 2 images"):
        eng.generate({"prompt": MARKUP, "images": [WIDE, TALL]}, P)
    assert not eng.has_unfinished() and eng.stats()["blocks_in_use"] == 0
    outs = eng.generate([{"prompt": MARKUP + "fine", "images": [WIDE]},
                         {"prompt": "<image><image>", "images": [WIDE, TALL]}], P, errors="return")
    assert outs[0].error is None and len(outs[0].token_ids) == P.max_tokens
    assert outs[1].error is None  # "<image>" brings its own start and end tokens: not adjacent


def test_server_chat_with_an_image_uses_the_models_chat_template(qwen_dirs, oracle):
    """`mmkv serve`'s chat API on a Qwen-VL model: the image part becomes the model's own image
    markup through its chat template, and the answer is transformers'."""
    running = start_server(qwen_engine(qwen_dirs, "qwen2_5_vl"))
    question = [{"type": "text", "text": "what is it?"}]
    try:
        response = httpx.post(f"{running.url}/v1/chat/completions", timeout=60, json={
            "model": MODEL_NAME, "max_tokens": P.max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": png_data_url(WIDE)}}, *question]}]})
    finally:
        running.stop()
    processor = load_oracle("qwen2_5_vl", qwen_dirs["qwen2_5_vl"])[1]
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, *question]}],
                                         add_generation_prompt=True, tokenize=False)
    prompt, answer = oracle("qwen2_5_vl", text, [WIDE])
    body = response.json()
    assert body["usage"]["prompt_tokens"] == len(prompt)
    assert body["choices"][0]["message"]["content"] == processor.tokenizer.decode(
        answer, skip_special_tokens=True)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_fused_layers_equal_the_modules_bit_for_bit(qwen_dirs, family, monkeypatch):
    """Qwen2-VL's and Qwen2.5-VL's decoder layers run fused, with M-RoPE's per-row cos/sin."""
    assert_same_as_modules(lambda: qwen_engine(qwen_dirs, family, max_num_batched_tokens=16),
                           [{"prompt": text, "images": images} for text, images in REQUESTS], monkeypatch)
