"""Engine behaviour beyond greedy equality: sampling, streaming, stops, bad input, a soak run."""

import itertools
import json
import pickle
import random
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

import mmkv.engine_core as engine_module
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


def test_a_seeded_requests_sample_i_draws_as_seed_plus_i_alone(model_dirs):
    """Samples forked at the first token each draw with their own generator: sample ``i`` of a
    request seeded ``s`` is what a one-sample request seeded ``s + i`` draws."""
    eng = engine(model_dirs)
    [prompt] = prompts(16, [10])
    sampled = SamplingParams(max_tokens=10, temperature=1.0, seed=5, ignore_eos=True)
    together = [o.token_ids for o in eng.generate([prompt], replace(sampled, n=3))[0].outputs]
    alone = [eng.generate([prompt], replace(sampled, seed=5 + i))[0].token_ids for i in range(3)]
    assert together == alone and len({tuple(t) for t in alone}) == 3


def test_step_seconds_split_prompt_steps_from_decoding_steps(model_dirs, monkeypatch):
    """A step's seconds count as prefill when it computes more than each sequence's pending token
    (every chunk of a chunked prompt), else as decoding: on a clock that ticks a second a reading,
    a 30-token prompt in chunks of 8 and 5 tokens decoded after its first."""
    ticks = itertools.count()
    monkeypatch.setattr(engine_module, "time", SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    eng = engine(model_dirs, max_num_batched_tokens=8)
    eng.generate(prompts(21, [30]), SamplingParams(max_tokens=6, ignore_eos=True))
    stats = eng.stats()
    assert (stats["step_seconds_prefill"], stats["step_seconds_decode"]) == (4.0, 5.0)


def test_streaming_yields_growing_outputs(model_dirs, hf_oracle):
    eng = engine(model_dirs)
    [prompt] = prompts(13, [6])
    seen = [out.token_ids for out in eng.stream(prompt, GREEDY)]
    assert [len(s) for s in seen] == list(range(1, 17))
    assert seen[-1] == hf_oracle("llama", prompt, 16)


def test_outputs_decode_their_text_when_read_and_carry_it_when_pickled(model_dirs):
    """A step's outputs decode lazily: ``generate`` decodes nothing until a text is read, then
    that request's tokens once; each streamed output's text is its own tokens'; a pickled output
    carries its text, not the tokenizer."""
    eng = engine(model_dirs)
    decode, calls = eng.tokenizer.decode, []
    eng.tokenizer.decode = lambda ids, **options: calls.append(len(ids)) or decode(ids, **options)
    outs = eng.generate(["Hello mmkv", "Hello mmkv!"], GREEDY)
    assert calls == []
    assert outs[0].text == decode(outs[0].token_ids, skip_special_tokens=True)
    assert calls == [len(outs[0].token_ids)]
    streamed = list(eng.stream("Hello", GREEDY))
    assert [s.text for s in streamed] == [decode(s.token_ids, skip_special_tokens=True)
                                          for s in streamed]
    data = pickle.dumps(outs[1])
    assert len(data) < 2000 and pickle.loads(data).outputs == outs[1].outputs
    assert pickle.loads(data).text == outs[1].text


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
    eng.preparer.eos_token_ids = {want[5]}  # a request reads them when it is prepared
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
    ("max_tokens", -1, "max_tokens must be >= 0, got -1"),
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
    """300 random requests (a third sampled, seeded) through a pool that forces evictions and
    preemptions give what a roomy pool gives."""
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
    for p, w, g in zip(params, want, got):  # seeded samples too: preemption changes nothing
        assert g.finish_reason == "length" and len(g.token_ids) == p.max_tokens
        assert g.token_ids == w.token_ids
    assert stats["blocks_in_use"] == 0
    tight.kv.check_integrity()


def test_cache_salt_keeps_tenants_apart(model_dirs, hf_oracle):
    """Requests share cached K/V only under the same salt, also when submitted together."""
    eng = engine(model_dirs)
    [doc] = prompts(19, [30])
    questions = prompts(20, [5, 6, 7, 8])
    a = eng.generate([doc + questions[0]], GREEDY, cache_salt="tenant-a")[0]
    b = eng.generate([doc + questions[1]], GREEDY, cache_salt="tenant-b")[0]
    unsalted = eng.generate([doc + questions[2]], GREEDY)[0]
    again = eng.generate([doc + questions[3]], GREEDY, cache_salt="tenant-a")[0]
    assert [o.cached_tokens for o in (a, b, unsalted, again)] == [0, 0, 0, 30]
    for q, out in zip(questions, (a, b, unsalted, again)):
        assert out.token_ids == hf_oracle("llama", doc + q, 16)
    fresh = engine(model_dirs)
    fresh.add_request(doc + questions[0], GREEDY, cache_salt="x")
    fresh.add_request(doc + questions[1], GREEDY, cache_salt="y")
    while fresh.has_unfinished():
        fresh.step()
    assert fresh.stats()["computed_prefill_tokens"] == 2 * 30 + 5 + 6  # nothing shared


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "draft_model"])
def test_resize_kv_cache_while_requests_run(model_dirs, hf_oracle, speculative):
    """The pool shrinks to just above what is in use mid-run (evicting the older cached prefixes
    at its low end and moving live blocks down), then grows: outputs stay the oracle's, and the
    shared document's cached blocks survive both moves."""
    from test_speculative_engine import draft_engine

    [doc] = prompts(21, [30])
    questions = prompts(22, [4, 5, 6, 7, 8, 9])
    eng = draft_engine(model_dirs["llama"], model_dirs["llama"], blocks=96) if speculative \
        else engine(model_dirs, blocks=96)
    per_block = eng.kv.bytes_per_block
    eng.generate(prompts(23, [20, 20]), GREEDY)  # cached, unused blocks at the low end
    ids = {eng.add_request(doc + q, GREEDY): doc + q for q in questions}
    done, steps = {}, 0
    while eng.has_unfinished():
        done.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
        steps += 1
        if steps == 3:
            in_use = eng.stats()["blocks_in_use"]
            with pytest.raises(ValueError, match=f"{in_use} are in use"):
                eng.resize_kv_cache((in_use - 1) * per_block)
            with pytest.raises(ValueError, match="needs 13"):
                eng.resize_kv_cache(12 * per_block)
            evictions = eng.stats()["evictions"]
            assert eng.resize_kv_cache((in_use + 2) * per_block) == in_use + 2
            assert eng.stats()["evictions"] > evictions and eng.kv.metrics.compactions == 1
        if steps == 9:
            assert eng.resize_kv_cache(200 * per_block) == 200
    assert done == {i: hf_oracle("llama", p, 16) for i, p in ids.items()}
    stats = eng.stats()
    assert stats["blocks_total"] == 200 and stats["blocks_in_use"] == 0
    assert stats["preemptions_swap"] + stats["preemptions_recompute"] > 0  # the small pool bit
    later = eng.generate([doc + [7, 7]], GREEDY)[0]
    assert later.cached_tokens == 30 and later.token_ids == hf_oracle("llama", doc + [7, 7], 16)
    if speculative:
        assert stats["spec_acceptance_rate"] == 1.0  # the draft's store moved with the target's


def test_logprobs_equal_transformers_log_softmax(model_dirs):
    """Each generated token's logprob and its top alternatives are transformers' log-softmax of
    the logits at that position (greedy and sampled, n > 1, through chunked prefill)."""
    from test_engine_oracle import load_hf

    eng = engine(model_dirs, max_num_batched_tokens=7)
    [prompt] = prompts(19, [13])
    greedy, sampled = eng.generate([prompt, prompt], [
        SamplingParams(max_tokens=6, ignore_eos=True, logprobs=5),
        SamplingParams(max_tokens=6, ignore_eos=True, logprobs=0, n=2, temperature=1.0, seed=5)])
    model = load_hf(model_dirs["llama"])
    for out in [*greedy.outputs, *sampled.outputs]:
        with torch.no_grad():
            full = model(torch.tensor([prompt + out.token_ids])).logits[0].log_softmax(-1)
        want = full[len(prompt) - 1: len(prompt) - 1 + len(out.token_ids)]
        assert [lp.token_id for lp in out.logprobs] == out.token_ids
        got = torch.tensor([lp.logprob for lp in out.logprobs])
        torch.testing.assert_close(got, want[torch.arange(len(got)), out.token_ids], atol=1e-4, rtol=0)
        if out is greedy.outputs[0]:
            for lp, row in zip(out.logprobs, want):
                top = torch.topk(row, 5)
                assert [t for t, _ in lp.top] == top.indices.tolist()
                torch.testing.assert_close(torch.tensor([v for _, v in lp.top]), top.values,
                                           atol=1e-4, rtol=0)
    assert all(lp.top == [] for lp in sampled.outputs[0].logprobs)
    assert eng.generate([prompt], GREEDY)[0].outputs[0].logprobs is None


@pytest.mark.parametrize("value, message", [(-1, "logprobs must be >= 0"),
                                            (21, "logprobs must be <= 20"),
                                            (True, "logprobs must be an integer")])
def test_bad_logprobs(value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(logprobs=value)
