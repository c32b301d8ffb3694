"""Engine behaviour beyond greedy equality: sampling, streaming, stops, bad input, a soak run."""

import json
import random

import pytest

from mmkv import Engine, ModelLoadError, SamplingParams
from test_engine_oracle import GREEDY, engine as device_engine, prompts


def engine(model_dirs, **kw) -> Engine:
    """These tests compare outputs exactly: on the CPU in float32 whatever MMKV_TEST_DEVICE says."""
    return device_engine(model_dirs, device="cpu", **kw)


def test_seeded_sampling_is_reproducible_whatever_the_batch(model_dirs):
    eng = engine(model_dirs)
    [prompt] = prompts(11, [9])
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=1234,
                            ignore_eos=True)
    alone = eng.generate([prompt], params)[0].token_ids
    others = prompts(12, [5, 14, 21])
    crowd = eng.generate(others[:2] + [prompt] + others[2:],
                         [SamplingParams(max_tokens=12, temperature=1.0, seed=i) for i in range(2)]
                         + [params] + [GREEDY])[2].token_ids
    assert alone == crowd
    different = eng.generate([prompt], SamplingParams(max_tokens=12, temperature=0.9, seed=99,
                                                      ignore_eos=True))[0].token_ids
    assert different != alone


def test_streaming_yields_growing_outputs(model_dirs, hf_oracle):
    eng = engine(model_dirs)
    [prompt] = prompts(13, [6])
    seen = [out.token_ids for out in eng.stream(prompt, GREEDY)]
    assert [len(s) for s in seen] == list(range(1, 17))
    assert seen[-1] == hf_oracle("llama", prompt, 16)


def test_step_api_interleaves_requests(model_dirs, hf_oracle):
    eng = engine(model_dirs)
    a, b = prompts(14, [8, 12])
    ra = eng.add_request(a, GREEDY)
    eng.step()
    rb = eng.add_request(b, GREEDY)
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    assert done == {ra: hf_oracle("llama", a, 16), rb: hf_oracle("llama", b, 16)}


def test_string_prompts_stop_strings_and_stop_tokens(model_dirs, hf_oracle):
    eng = engine(model_dirs)
    text = "Hello mmkv"
    ids = list(text.encode())
    want = hf_oracle("llama", ids, 16)
    out = eng.generate(text, GREEDY)[0]
    assert out.prompt_token_ids == ids and out.token_ids == want
    assert out.text == eng.tokenizer.decode(want)
    stop_tok = eng.generate(text, SamplingParams(max_tokens=16, stop_token_ids=[want[3]]))[0]
    assert stop_tok.token_ids == want[: want.index(want[3]) + 1] and stop_tok.finish_reason == "stop"
    stop_str = eng.tokenizer.decode(want[4:6])
    stopped = eng.generate(text, SamplingParams(max_tokens=16, stop=[stop_str]))[0]
    assert stopped.finish_reason == "stop" and stop_str not in stopped.text
    assert stopped.text == eng.tokenizer.decode(want)[: eng.tokenizer.decode(want).find(stop_str)]


def test_chat_template_flag(model_dirs, hf_oracle):
    eng = engine(model_dirs)
    eng.tokenizer.chat_template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}>"
    out = eng.generate("hi", GREEDY, chat=True)[0]
    assert out.prompt_token_ids == list(b"[hi]>")
    assert out.token_ids == hf_oracle("llama", list(b"[hi]>"), 16)


def test_eos_ends_a_request_unless_ignored(model_dirs, hf_oracle):
    [prompt] = prompts(15, [7])
    want = hf_oracle("llama", prompt, 16)
    eng = engine(model_dirs)
    eng.eos_token_ids = {want[5]}
    out = eng.generate([prompt], SamplingParams(max_tokens=16))[0]
    assert out.token_ids == want[: want.index(want[5]) + 1] and out.finish_reason == "stop"
    assert eng.generate([prompt], GREEDY)[0].token_ids == want


@pytest.mark.parametrize("prompt, params, message", [
    ([], GREEDY, "prompt is empty"),
    ("", GREEDY, "prompt is empty"),
    ([1] * 600, GREEDY, "max_model_len is 512"),
    ([1] * 100, SamplingParams(max_tokens=200), "pool holds 64"),
    ([1, 999], GREEDY, r"token ids must be integers in \[0, 256\)"),
    ([1, 2], "greedy", "SamplingParams"),
    (3.5, GREEDY, "prompt must be a string or a list"),
])
def test_bad_requests_fail_alone_at_submission(model_dirs, hf_oracle, prompt, params, message):
    eng = engine(model_dirs, blocks=64)
    good = prompts(16, [9, 13])
    ids = [eng.add_request(p, GREEDY) for p in good]
    eng.step()
    with pytest.raises(ValueError, match=message):
        eng.add_request(prompt, params)
    with pytest.raises(ValueError, match=message):
        eng.generate([good[0], prompt], params)  # validated before anything is queued
    finished = {}
    while eng.has_unfinished():
        finished.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
    assert finished == {i: hf_oracle("llama", p, 16) for i, p in zip(ids, good)}
    assert eng.stats()["blocks_in_use"] == 0


@pytest.mark.parametrize("field, value, message", [
    ("max_tokens", 0, "max_tokens must be >= 1, got 0"),
    ("temperature", -0.5, "temperature must be a finite number >= 0"),
    ("top_p", 0.0, r"top_p must be in \(0, 1\]"),
    ("top_k", -1, "top_k must be >= 0"),
    ("n", 0, "n must be >= 1"),
    ("stop", [""], "stop must be non-empty strings"),
    ("seed", "x", "seed must be an integer"),
])
def test_sampling_params_name_the_bad_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_model_directory_errors(tmp_path, model_dirs):
    with pytest.raises(ModelLoadError, match="does not exist"):
        Engine(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="has no config.json"):
        Engine(tmp_path / "empty")
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not a valid model config"):
        Engine(corrupt)
    (corrupt / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 8}))
    with pytest.raises(ModelLoadError, match="not supported"):
        Engine(corrupt)
    with pytest.raises(ValueError, match="memory size"):
        Engine(model_dirs["llama"], kv_cache_memory="lots")
    with pytest.raises(ValueError, match="preemption must be one of"):
        Engine(model_dirs["llama"], kv_cache_memory="64KiB", preemption="sometimes")


def test_soak_under_memory_pressure(model_dirs):
    """300 random requests through a pool that forces evictions and preemptions."""
    rng = random.Random(17)
    docs = prompts(18, [13, 22, 9])
    batch, params = [], []
    for i in range(300):
        base = rng.choice(docs + [[]])
        batch.append(base + [rng.randrange(256) for _ in range(rng.randrange(1, 12))])
        greedy = i % 3 != 0
        params.append(SamplingParams(max_tokens=rng.randrange(1, 12), ignore_eos=True,
                                     temperature=0.0 if greedy else 0.8, seed=i,
                                     priority=rng.randrange(3)))
    roomy = engine(model_dirs, blocks=4096, debug=False)
    want = roomy.generate(batch, params)
    tight = engine(model_dirs, blocks=40, max_num_batched_tokens=64)
    got = tight.generate(batch, params)
    stats = tight.stats()
    assert stats["evictions"] > 0 and stats["preemptions_swap"] + stats["preemptions_recompute"] > 0
    for p, w, g in zip(params, want, got):
        assert g.finish_reason == "length" and len(g.token_ids) == p.max_tokens
        if p.greedy:
            assert g.token_ids == w.token_ids
    assert stats["blocks_in_use"] == 0
    tight.kv.check_integrity()
