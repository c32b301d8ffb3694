"""`mmkv serve` driven by the official `openai` client (sync and async) and raw httpx, on a real
uvicorn server on a loopback port. Answers are checked against the offline Engine on the same
prompts; block accounting against the engine itself."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import re

import httpx
import openai
import pytest

import mmkv

from mmkv import SamplingParams
from mmkv.server.media import MediaLoader, MediaPolicy
from mmkv.server.metrics import ServerMetrics
from mmkv.synthetic import scene_prompt
from server_harness import (MODEL_NAME, REPORT_QUESTIONS, SCENE_QUESTIONS, bundled_engine,
                            free_socket, png_data_url, report_chat, report_prompt, scene_chat,
                            scenes_and_reports, start_server)

ROOT = Path(__file__).parent.parent
TOKENS = 12


@pytest.fixture(scope="module")
def served():
    running = start_server(bundled_engine())
    yield running
    running.stop()
    running.engine.check_integrity()


@pytest.fixture(scope="module")
def offline():
    return bundled_engine()


def client(served, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, **kw)


def async_client(served) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)


def test_models_health_and_metric_names(served):
    assert client(served).models.list().data[0].id == MODEL_NAME
    assert httpx.get(f"{served.url}/health").status_code == 200
    names = set(served.metrics())
    for name in ("mmkv_requests_running", "mmkv_requests_waiting", "mmkv_kv_blocks_in_use",
                 "mmkv_kv_blocks_total", "mmkv_prompt_tokens_total", "mmkv_cached_prompt_tokens_total",
                 "mmkv_generation_tokens_total", "mmkv_encoder_calls_total", "mmkv_preemptions_total",
                 "mmkv_preemptions_swap_total", "mmkv_preemptions_recompute_total",
                 "mmkv_recomputed_tokens_total", "mmkv_swapped_bytes_total",
                 "mmkv_max_preemptions_per_request", "mmkv_evictions_total",
                 "mmkv_spec_drafted_tokens_total", "mmkv_spec_accepted_tokens_total",
                 "mmkv_xattn_blocks_computed_total", "mmkv_xattn_blocks_reused_total",
                 "mmkv_kv_usage_fraction", "mmkv_prefix_cache_hit_rate",
                 "mmkv_time_to_first_token_seconds_count", "mmkv_request_latency_seconds_count"):
        assert name in names, name


def test_preemption_metrics_sum_counts_and_take_the_largest_maximum():
    """Over two replicas: counters add up, the most preemptions of one request is the larger."""
    text = ServerMetrics().render({
        "a": {"preemptions_swap": 2, "preemptions_recompute": 1, "recomputed_tokens": 40,
              "max_preemptions_per_request": 3},
        "b": {"preemptions_swap": 0, "preemptions_recompute": 4, "recomputed_tokens": 8,
              "max_preemptions_per_request": 1}}).decode()
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("mmkv_") and "{" not in line)
    assert float(values["mmkv_preemptions_total"]) == 7 and float(values["mmkv_preemptions_swap_total"]) == 2
    assert float(values["mmkv_recomputed_tokens_total"]) == 48
    assert float(values["mmkv_max_preemptions_per_request"]) == 3


def test_ratios_are_taken_over_every_replicas_sums():
    """Two replicas: the KV usage fraction is blocks in use over blocks in both pools, the hit
    rate cached prompt tokens over prompt tokens, not a sum or mean of each replica's ratio."""
    text = ServerMetrics().render({
        "a": {"blocks_in_use": 10, "blocks_total": 100, "cached_prompt_tokens": 30, "prompt_tokens": 40},
        "b": {"blocks_in_use": 30, "blocks_total": 300, "cached_prompt_tokens": 0, "prompt_tokens": 60}}).decode()
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("mmkv_") and "{" not in line)
    assert float(values["mmkv_kv_usage_fraction"]) == pytest.approx(0.1)
    assert float(values["mmkv_prefix_cache_hit_rate"]) == pytest.approx(0.3)


def test_stats_endpoint_is_the_engines_and_shows_image_reuse(served):
    """``GET /v1/stats`` is the engine's ``stats()``: after the same image asked about twice, its
    cross-attention K/V blocks were computed once and reused once, as each response's
    ``usage.mmkv`` says, and /metrics says the same."""
    scene_url = png_data_url(scenes_and_reports(11, 1, 0)[0][0].render())
    before = httpx.get(f"{served.url}/v1/stats").json()["replicas"]["0"]
    usages = []
    for question in ("how many shapes?", "what colour is the circle?"):
        chat = client(served).chat.completions.create(model=MODEL_NAME, max_tokens=3, temperature=0, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": scene_url}},
                                         {"type": "text", "text": question}]}])
        usages.append(chat.usage.model_extra["mmkv"])
    first, second = usages  # the usage extension: what each request computed and reused
    assert (first["images"], first["images_encoded"], first["xattn_blocks_reused"]) == (1, 1, 0)
    assert (second["images"], second["images_encoded"], second["xattn_blocks_computed"]) == (1, 0, 0)
    assert second["xattn_blocks_reused"] == first["xattn_blocks_computed"] > 0
    assert second["prompt_tokens_computed"] == chat.usage.prompt_tokens - chat.usage.prompt_tokens_details.cached_tokens
    after = httpx.get(f"{served.url}/v1/stats").json()["replicas"]["0"]
    computed = after["xattn_blocks_computed"] - before["xattn_blocks_computed"]
    reused = after["xattn_blocks_reused"] - before["xattn_blocks_reused"]
    assert computed > 0 and reused == computed
    assert after["encoder_calls"] - before["encoder_calls"] == 1
    assert served.metrics()["mmkv_xattn_blocks_reused_total"] == after["xattn_blocks_reused"]


def test_tokenize_says_what_the_cache_would_serve(served, offline):
    """``POST /tokenize``: a report's prompt is the offline engine's tokens; once a request with it
    ran, the same prompt with another question shows its shared prefix cached (the leading
    tokens the next request will take from the tree, as its usage then says); chat messages with
    an image give the image's span; ``/detokenize`` inverts it."""
    _, [report] = scenes_and_reports(12, 0, 1)
    first, second = report_prompt(report, REPORT_QUESTIONS[0]), report_prompt(report, REPORT_QUESTIONS[1])
    cold = httpx.post(f"{served.url}/tokenize", json={"prompt": second}).json()
    assert cold["tokens"] == offline.tokenizer.encode(second) and cold["count"] == len(cold["tokens"])
    assert cold["cached_tokens"] == 0 and cold["images"] == []
    client(served).completions.create(model=MODEL_NAME, prompt=first, max_tokens=2)
    warm = httpx.post(f"{served.url}/tokenize", json={"model": MODEL_NAME, "prompt": second}).json()
    shared = next(i for i, (a, b) in enumerate(zip(offline.tokenizer.encode(first), warm["tokens"])) if a != b)
    assert warm["cached_tokens"] == shared > 0
    used = client(served).completions.create(model=MODEL_NAME, prompt=second, max_tokens=2).usage
    assert used.prompt_tokens_details.cached_tokens == warm["cached_tokens"]
    scene_url = png_data_url(scenes_and_reports(13, 1, 0)[0][0].render())
    chat = httpx.post(f"{served.url}/tokenize", json={"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": scene_url}},
                                     {"type": "text", "text": "how many?"}]}]}).json()
    [span] = chat["images"]
    assert span["length"] >= 1 and chat["tokens"][span["start"]] == offline.model.image_token_id
    text = httpx.post(f"{served.url}/detokenize", json={"tokens": cold["tokens"]}).json()["prompt"]
    assert offline.tokenizer.encode(text) == cold["tokens"]
    for path, body, message in (("/tokenize", {"prompt": "x", "messages": []}, "exactly one of prompt and messages"),
                                ("/tokenize", {"model": "other", "prompt": "x"}, "does not exist"),
                                ("/detokenize", {"tokens": [5, 10**6]}, "tokens holds 1000000")):
        r = httpx.post(f"{served.url}{path}", json=body)
        assert r.status_code in (400, 404) and message in r.json()["error"]["message"], r.text


def test_concurrent_chat_and_completions_equal_the_offline_engine(served, offline):
    """24 concurrent clients mixing scene chats, report chats and report completions."""
    scenes, reports = scenes_and_reports(1, 3, 3)
    jobs = [("scene", s, q) for s in scenes for q in SCENE_QUESTIONS[:3]]
    jobs += [(kind, r, q) for r in reports for q in REPORT_QUESTIONS[:2] for kind in ("chat", "text")]
    want = offline.generate(
        [{"prompt": scene_prompt(q), "images": [s.render()]} if kind == "scene" else report_prompt(s, q)
         for kind, s, q in jobs], SamplingParams(max_tokens=TOKENS))
    before = served.metrics()

    async def ask(api, kind, subject, question):
        if kind == "text":
            r = await api.completions.create(model=MODEL_NAME, prompt=report_prompt(subject, question),
                                             max_tokens=TOKENS, temperature=0)
            return r.choices[0].text, r.usage
        chat = scene_chat(subject, question) if kind == "scene" else report_chat(subject, question)
        r = await api.chat.completions.create(model=MODEL_NAME, messages=chat, max_tokens=TOKENS,
                                              temperature=0)
        return r.choices[0].message.content, r.usage

    async def run():
        api = async_client(served)
        return await asyncio.gather(*[ask(api, *job) for job in jobs])

    got = asyncio.run(run())
    assert [text for text, _ in got] == [w.text for w in want]
    for (text, use), w in zip(got, want):
        assert (use.prompt_tokens, use.completion_tokens) == (len(w.prompt_token_ids), len(w.token_ids))
    assert sum(use.prompt_tokens_details.cached_tokens for _, use in got) > 0
    seen_again = client(served).chat.completions.create(
        model=MODEL_NAME, messages=report_chat(reports[0], REPORT_QUESTIONS[3]), max_tokens=4, temperature=0)
    assert seen_again.usage.prompt_tokens_details.cached_tokens >= 16  # the report's full blocks
    after = served.wait_idle()
    assert after["mmkv_encoder_calls_total"] - before["mmkv_encoder_calls_total"] == len(scenes)
    assert after["mmkv_kv_blocks_in_use"] == 0


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_streamed_text_equals_the_non_streamed_text(served, endpoint):
    _, [report] = scenes_and_reports(2, 0, 1)
    api = client(served)
    args = dict(model=MODEL_NAME, max_tokens=24, temperature=0, stop=[", founded", "xyz"], n=2)
    if endpoint == "chat":
        call = api.chat.completions.create
        args["messages"] = report_chat(report, "summarise the report.")
        text = lambda choice: choice.message.content  # noqa: E731
        delta = lambda choice: choice.delta.content or ""  # noqa: E731
    else:
        call = api.completions.create
        args["prompt"] = report_prompt(report, "summarise the report.")
        text = lambda choice: choice.text  # noqa: E731
        delta = lambda choice: choice.text  # noqa: E731
    whole = call(**args)
    chunks = list(call(**args, stream=True, stream_options={"include_usage": True}))
    for i in range(2):
        streamed = "".join(delta(c.choices[0]) for c in chunks if c.choices and c.choices[0].index == i)
        assert streamed == text(whole.choices[i]) and ", founded" not in streamed
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].index == i
                and c.choices[0].finish_reason] == [whole.choices[i].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_seeded_sampling_with_n_is_reproducible(served):
    api = client(served)
    args = dict(model=MODEL_NAME, prompt="zq xv wj", max_tokens=10, temperature=1.5, top_p=0.95,
                seed=7, n=3, extra_body={"top_k": 200, "ignore_eos": True})
    first, second = api.completions.create(**args), api.completions.create(**args)
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in second.choices] and len(set(texts)) > 1
    assert first.usage.completion_tokens == 30


def test_logprobs_are_the_engines(served, offline):
    _, [report] = scenes_and_reports(3, 0, 1)
    prompt = report_prompt(report, REPORT_QUESTIONS[1])
    want = offline.generate(prompt, SamplingParams(max_tokens=6, logprobs=3))[0].outputs[0]
    chat = client(served).chat.completions.create(
        model=MODEL_NAME, messages=report_chat(report, REPORT_QUESTIONS[1]), max_tokens=6,
        temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert [c.token for c in content] == [offline.tokenizer.decode([lp.token_id]) for lp in want.logprobs]
    assert [c.logprob for c in content] == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-5)
    assert [t.logprob for c in content for t in c.top_logprobs] == pytest.approx(
        [v for lp in want.logprobs for _, v in lp.top], abs=1e-5)
    assert [t.token for c in content for t in c.top_logprobs] == [
        offline.tokenizer.decode([i]) for lp in want.logprobs for i, _ in lp.top]
    text = client(served).completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6,
                                             temperature=0, logprobs=2)
    assert text.choices[0].logprobs.token_logprobs == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-5)


TOWN = {"type": "object", "properties": {"mayor": {"type": "string", "maxLength": 12},
                                        "founded": {"type": "integer", "minimum": 1000, "maximum": 2100}},
        "required": ["mayor", "founded"], "additionalProperties": False}


def test_structured_output_as_the_openai_client_asks_for_it(served, offline):
    """``response_format`` json_schema (strict) and json_object with the ``openai`` client, vLLM's
    ``structured_outputs`` and ``guided_*`` fields, and ``logit_bias``: sampled outputs match, and a
    greedy one equals the offline engine's with the same constraint."""
    import jsonschema

    _, [report] = scenes_and_reports(4, 0, 1)
    api = client(served)
    chat = api.chat.completions.create(
        model=MODEL_NAME, messages=report_chat(report, "describe the town as json."), max_tokens=80,
        temperature=1.0, seed=2, n=4,
        response_format={"type": "json_schema", "json_schema": {"name": "town", "schema": TOWN, "strict": True}})
    for choice in chat.choices:
        jsonschema.validate(json.loads(choice.message.content), TOWN)
    obj = api.chat.completions.create(model=MODEL_NAME, messages=report_chat(report, "json please"),
                                      max_tokens=120, temperature=0, response_format={"type": "json_object"})
    prompt = report_prompt(report, "json please")
    want = offline.generate(offline.render_chat(report_chat(report, "json please")),
                            SamplingParams(max_tokens=120, structured=mmkv.StructuredOutput(json_object=True)))[0]
    assert obj.choices[0].message.content == want.outputs[0].text
    for extra in ({"structured_outputs": {"choice": ["yes", "no"]}}, {"guided_choice": ["yes", "no"]}):
        done = api.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=1.0,
                                      seed=1, n=6, extra_body=extra)
        assert {c.text for c in done.choices} <= {"yes", "no"}
    regex = api.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=1.0, seed=3,
                                   extra_body={"guided_regex": "[0-9]{3}"})
    assert re.fullmatch("[0-9]{3}", regex.choices[0].text)
    token = offline.tokenizer.encode("q", add_special_tokens=False)[0]
    biased = api.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=3, temperature=0,
                                    logit_bias={str(token): 100})
    assert biased.choices[0].text == "qqq"


def test_penalties_min_p_and_min_tokens_are_the_engines(served, offline):
    """OpenAI's penalties through the ``openai`` client, vLLM's ``repetition_penalty``,
    ``min_tokens`` and ``min_p`` as extra fields, and llama-server's ``repeat_penalty`` over the
    whole context, on chat and completions: each answer equals the offline engine's with the
    same ``SamplingParams``, and a penalty's differs from the unpenalised one (run past the end
    with ``ignore_eos``: the bundled model's short answers repeat nothing to penalise)."""
    _, [report] = scenes_and_reports(5, 0, 1)
    api, prompt = client(served), report_prompt(report, REPORT_QUESTIONS[0])
    messages = [{"role": "user", "content": "tell me a story."}]
    chat_prompt = offline.render_chat(messages)

    def offline_text(prompt, ignore_eos=True, **params):
        return offline.generate(prompt, SamplingParams(max_tokens=40, ignore_eos=ignore_eos, **params))[0].outputs[0].text

    chat = api.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=40, temperature=0,
                                       frequency_penalty=2.0, presence_penalty=1.0, extra_body={"ignore_eos": True})
    text = chat.choices[0].message.content
    assert text == offline_text(chat_prompt, frequency_penalty=2.0, presence_penalty=1.0) != offline_text(chat_prompt)
    for extra, params in [({"repetition_penalty": 2.0}, dict(repetition_penalty=2.0)),
                          ({"repeat_penalty": 2.0, "repeat_last_n": -1}, dict(repetition_penalty=2.0)),
                          ({"min_tokens": 30, "ignore_eos": False}, dict(min_tokens=30, ignore_eos=False))]:
        text = api.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=40, temperature=0,
                                      extra_body={"ignore_eos": True, **extra}).choices[0].text
        assert text == offline_text(prompt, **params) != offline_text(prompt, ignore_eos=params.get("ignore_eos", True)), extra
    sampled = api.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=1.0, seed=4,
                                     extra_body={"min_p": 0.3}).choices[0].text
    assert sampled == offline.generate(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=4, min_p=0.3))[
        0].outputs[0].text


@pytest.mark.parametrize("body, message", [
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens must be <= max_tokens (10), got 20"),
    ({"min_p": 1.5}, "min_p"),
    ({"repeat_penalty": 1.1}, "repeat_penalty is applied over the whole context only: send repeat_last_n: -1"),
    ({"repeat_penalty": 1.1, "repeat_last_n": -1, "repetition_penalty": 1.2}, "repeat_penalty and repetition_penalty differ"),
    ({"typical_p": 0.9}, "typical_p is not supported; allowed: 1 or 1.0"),
    ({"bad_words": ["x"]}, "bad_words is not supported; allowed: null or []"),
    ({"use_beam_search": True}, "use_beam_search is not supported; allowed: false"),
    ({"truncate_prompt_tokens": 8}, "truncate_prompt_tokens is not supported; allowed: null"),
    ({"mirostat": 2}, "mirostat is not supported; allowed: 0"),
    ({"dry_multiplier": 0.8}, "dry_multiplier is not supported"),
])
def test_a_sampling_field_mmkv_does_not_honour_is_a_400_naming_it(served, body, message):
    """No field that vLLM or llama-server define for sampling is silently ignored; their values
    that change nothing pass."""
    r = post(served, "/v1/completions", {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2, **body})
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] in body
    neutral = {"typical_p": 1.0, "bad_words": [], "use_beam_search": False, "mirostat": 0, "skip_special_tokens": True}
    ok = post(served, "/v1/completions", {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2, **neutral})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("body, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "needs json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format type must be text, json_object or json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "invalid json_schema"),
    ({"structured_outputs": {"choices": ["a"]}}, "structured_outputs takes choice"),
    ({"guided_regex": "[a", "guided_choice": ["a"]}, "ask for one structured output"),
    ({"guided_regex": "[unclosed"}, "invalid regex"),
    ({"logit_bias": {"abc": 1}}, "logit_bias keys must be token ids"),
    ({"logit_bias": {"5": 300}}, "logit_bias values must be numbers in [-100, 100]"),
])
def test_a_bad_structured_output_is_a_400_naming_it(served, body, message):
    r = post(served, CHAT, {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], **body})
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert client(served).completions.create(model=MODEL_NAME, prompt="still here", max_tokens=2).choices


def test_cache_salt_keeps_tenants_apart(served):
    _, [report] = scenes_and_reports(4, 0, 1)
    api = client(served)

    def cached(salt):
        return api.chat.completions.create(
            model=MODEL_NAME, messages=report_chat(report, "summarise the report."), max_tokens=2,
            temperature=0, extra_body={"cache_salt": salt}).usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0
    assert cached("tenant-a") > 0


def post(served, path, body, **kw):
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(f"{served.url}{path}", content=content, headers={"content-type": "application/json"},
                      timeout=30, **kw)


CHAT = "/v1/chat/completions"


def image_chat(url: str) -> dict:
    return {"model": MODEL_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what is it?"}]}]}


@pytest.mark.parametrize("path, body, status, message", [
    (CHAT, b"{not json", 400, "not valid JSON"),
    (CHAT, b"[1, 2]", 400, "must be a JSON object"),
    (CHAT, {"model": MODEL_NAME}, 400, "messages"),
    (CHAT, {"model": MODEL_NAME, "messages": []}, 400, "messages"),
    (CHAT, {"model": MODEL_NAME, "messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
    (CHAT, {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": "many"},
     400, "max_tokens"),
    (CHAT, {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "temperature": 3},
     400, "temperature"),
    (CHAT, {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "presence_penalty": 3},
     400, "presence_penalty"),
    (CHAT, {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "n": 99}, 400, "n"),
    (CHAT, {"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}, 404, "does not exist"),
    (CHAT, {"model": MODEL_NAME, "messages": [{"role": "user", "content": "word " * 2000}]}, 400,
     "max_model_len is 1024"),
    (CHAT, image_chat("data:image/png;base64,!!!!"), 400, "not valid base64"),
    (CHAT, image_chat("data:image/png;base64," + "aGVsbG8="), 400, "not a readable image"),
    (CHAT, image_chat("file:///etc/passwd"), 400, "no --allowed-local-media-path"),
    (CHAT, image_chat("http://example.com/a.png"), 400, "is not https"),
    (CHAT, image_chat("https://example.com/a.png"), 400, "not allowed; allowed hosts: none"),
    (CHAT, image_chat("ftp://example.com/a.png"), 400, "scheme 'ftp' is not supported"),
    ("/tokenize", image_chat("https://example.com/a.png"), 400,
     "image 0: image host 'example.com' is not allowed; allowed hosts: none"),
    ("/tokenize", image_chat("file:///etc/passwd"), 400, "image 0: file:// image URLs are refused"),
    ("/tokenize", {"prompt": "word " * 2000}, 400, "max_model_len is 1024"),
    ("/tokenize", b"x" * (16 * 2**20 + 1), 413, "limit"),
    ("/detokenize", b"x" * (16 * 2**20 + 1), 413, "limit"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": [1, 99999]}, 400, "token ids must be integers"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": []}, 400, "prompt is empty"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    (CHAT, b"x" * (16 * 2**20 + 1), 413, "limit"),
    ("/v1/nowhere", {}, 404, "Not Found"),
])
def test_errors_have_openai_bodies_and_the_server_keeps_answering(served, path, body, status, message):
    r = post(served, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and message in error["message"]
    answer = client(served).completions.create(model=MODEL_NAME, prompt="report on x.", max_tokens=2)
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_openai_client_raises_its_own_error_types(served):
    api = client(served)
    with pytest.raises(openai.NotFoundError):
        api.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="max_tokens must be >= 1|max_tokens"):
        api.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], max_tokens=0)


LONG = {"model": MODEL_NAME, "prompt": "report on kalo.", "max_tokens": 900, "stream": True,
        "ignore_eos": True}


@contextmanager
def long_stream(url: str):
    """A streamed completion that runs for a while; yields its lines after the first."""
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{url}/v1/completions", json=LONG) as response:
            assert response.status_code == 200
            lines = response.iter_lines()  # kept: dropping it would close the connection
            assert next(lines).startswith("data: ")
            yield lines


def test_a_client_that_disconnects_mid_stream_is_aborted(served):
    before = served.wait_idle()["mmkv_generation_tokens_total"]  # the module's other tests generate too
    with long_stream(served.url):
        assert served.metrics()["mmkv_requests_running"] == 1
    m = served.wait_idle()
    assert (m["mmkv_requests_running"], m["mmkv_kv_blocks_in_use"]) == (0, 0)
    with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
        httpx.post(f"{served.url}/v1/completions", json={**LONG, "stream": False}, timeout=0.5)
    m = served.wait_idle()
    assert (m["mmkv_requests_running"], m["mmkv_kv_blocks_in_use"]) == (0, 0)
    assert m["mmkv_generation_tokens_total"] - before < 1000  # neither ran to its 900 tokens


def test_a_request_that_fails_inside_the_engine_fails_alone(served):
    """A forward pass that raises for one request's batch: that request gets a 500, a concurrent
    one its answer, and the server goes on serving."""
    engine = served.engine
    forward = engine.model.forward

    def poisoned(input_ids, step, rows):
        if bool((input_ids == engine.tokenizer.encode("~")[0]).any()):
            raise RuntimeError("poisoned batch")
        return forward(input_ids, step, rows)

    engine.model.forward = poisoned
    try:
        async def run():
            api = async_client(served)
            return await asyncio.gather(
                api.completions.create(model=MODEL_NAME, prompt="report on ~.", max_tokens=4),
                api.completions.create(model=MODEL_NAME, prompt="report on kalo.", max_tokens=4,
                                       temperature=0), return_exceptions=True)

        bad, good = asyncio.run(run())
    finally:
        engine.model.forward = forward
    assert isinstance(bad, openai.InternalServerError) and "poisoned batch" in str(bad)
    assert good.choices[0].text == client(served).completions.create(
        model=MODEL_NAME, prompt="report on kalo.", max_tokens=4, temperature=0).choices[0].text
    assert served.wait_idle()["mmkv_kv_blocks_in_use"] == 0


def test_api_key_guards_every_route_but_health_and_the_page():
    running = start_server(bundled_engine(kv_cache_memory="4MiB"), api_key="sesame")
    try:
        assert httpx.get(f"{running.url}/health").status_code == 200
        for method, path in (("GET", "/metrics"), ("GET", "/v1/stats"), ("POST", "/tokenize"),
                             ("POST", "/detokenize"), ("GET", "/v1/models"),
                             ("GET", f"/v1/models/{MODEL_NAME}"),
                             ("POST", "/v1/completions"), ("POST", CHAT), ("GET", "/nowhere")):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
                r = httpx.request(method, f"{running.url}{path}", headers=headers)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{running.url}/v1", api_key="wrong", max_retries=0).models.list()
        api = openai.OpenAI(base_url=f"{running.url}/v1", api_key="sesame", max_retries=0)
        assert api.completions.create(model=MODEL_NAME, prompt="report on x.", max_tokens=2).usage.total_tokens > 0
        assert httpx.get(f"{running.url}/metrics", headers={"Authorization": "Bearer sesame"}).status_code == 200
        # with a key, the key guards: no Host is checked
        keyed = {"Host": "attacker.example", "Authorization": "Bearer sesame"}
        assert httpx.get(f"{running.url}/v1/models", headers=keyed).status_code == 200
    finally:
        running.stop()


def test_admission_limit_answers_503_before_fetching_any_image(tmp_path):
    scenes, _ = scenes_and_reports(5, 1, 0)
    path = tmp_path / "scene.png"
    scenes[0].render().save(path)
    running = start_server(bundled_engine(kv_cache_memory="8MiB", max_num_seqs=1), max_waiting=0)
    try:
        with long_stream(running.url):
            # this file:// URL would be refused with a 400; the 503 comes first, for /tokenize too
            for path_, body in ((CHAT, image_chat(path.as_uri())), ("/tokenize", image_chat(path.as_uri())),
                                ("/detokenize", {"tokens": [1, 2]})):
                r = post(running, path_, body)
                assert r.status_code == 503 and r.headers["Retry-After"] == "1", r.text
                assert r.json()["error"]["code"] == "overloaded"
        running.wait_idle()
        assert post(running, CHAT, image_chat(path.as_uri())).status_code == 400  # admitted now
        assert post(running, "/tokenize", image_chat(path.as_uri())).status_code == 400
        assert post(running, "/detokenize", {"tokens": [1, 2]}).status_code == 200
    finally:
        running.stop()


def test_a_client_that_leaves_tokenize_releases_its_admission_place(served, monkeypatch):
    """``/tokenize`` holds one admission place while its images load; a client that gives up has
    the loads cancelled and the place released."""
    started, cancelled = threading.Event(), threading.Event()

    async def hanging(self, urls):
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    monkeypatch.setattr(MediaLoader, "load_all", hanging)
    admission = served.server.front.admission
    with ThreadPoolExecutor(1) as pool:
        leaving = pool.submit(httpx.post, f"{served.url}/tokenize",
                              json=image_chat("data:image/png;base64,AAAA"), timeout=1.5)
        assert started.wait(10)
        assert admission.admitted == 1
        with pytest.raises(httpx.ReadTimeout):
            leaving.result()
    assert cancelled.wait(10)
    deadline = time.monotonic() + 10
    while admission.admitted and time.monotonic() < deadline:
        time.sleep(0.02)
    assert admission.admitted == 0


def test_local_media_only_under_the_allowed_directory(tmp_path):
    scenes, _ = scenes_and_reports(6, 1, 0)
    allowed, outside = tmp_path / "media", tmp_path / "private"
    allowed.mkdir(), outside.mkdir()
    scenes[0].render().save(allowed / "scene.png")
    scenes[0].render().save(outside / "secret.png")
    (allowed / "link.png").symlink_to(outside / "secret.png")
    engine = bundled_engine(kv_cache_memory="4MiB")
    want = engine.ask(scenes[0].render(), ["how many shapes are there?"], SamplingParams(max_tokens=4))[0].text
    running = start_server(engine, media=MediaPolicy(allowed_local_path=allowed))
    try:
        def ask(url):
            return post(running, CHAT, {**image_chat(url), "max_tokens": 4, "temperature": 0,
                                        "messages": [{"role": "user", "content": [
                                            {"type": "image_url", "image_url": {"url": url}},
                                            {"type": "text", "text": "how many shapes are there?"}]}]})

        ok = ask((allowed / "scene.png").as_uri())
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == want
        for url in ((outside / "secret.png").as_uri(), (allowed / "link.png").as_uri(),
                    f"file://{allowed}/../private/secret.png"):
            r = ask(url)
            assert r.status_code == 400 and "outside the allowed media directory" in r.json()["error"]["message"]
    finally:
        running.stop()


def test_remote_media_refused_after_dns_for_loopback():
    running = start_server(bundled_engine(kv_cache_memory="4MiB"),
                           media=MediaPolicy(allowed_domains=frozenset({"localhost"})))
    try:
        r = post(running, CHAT, image_chat(f"https://localhost:{running.url.rsplit(':', 1)[1]}/x.png"))
        assert r.status_code == 400 and "resolves to a non-public address" in r.json()["error"]["message"]
    finally:
        running.stop()


def test_sigterm_aborts_streams_and_exits_holding_no_block(tmp_path):
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    process = subprocess.Popen(
        [sys.executable, "-m", "mmkv", "serve", "--port", str(port), "--kv-cache-memory", "8MiB",
         "--host-kv-memory", "1MiB"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
                time.sleep(0.2)
        with long_stream(url) as lines:
            process.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]  # it ends (an error event, [DONE]) instead of hanging
        assert any("shutting down" in line for line in rest) and rest[-1] == "data: [DONE]"
        process.wait(timeout=20)
        stderr = process.stderr.read()
        assert "mmkv serve stopped: 0 KV blocks in use, block accounting checked" in stderr, stderr
        assert process.returncode in (0, -signal.SIGTERM)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_bounded_load_200_requests_from_32_clients(served, offline):
    """8 scenes and 4 reports; 200 requests from 32 concurrent async clients; every answer equals
    the offline engine's; nothing leaks."""
    scenes, reports = scenes_and_reports(9, 8, 4)
    jobs = []
    for i in range(200):
        if i % 2:
            jobs.append(("scene", scenes[i % 8], SCENE_QUESTIONS[i % 4 if i % 4 != 2 else 0]))
        else:
            jobs.append(("report", reports[i % 4], REPORT_QUESTIONS[(i // 4) % 4]))
    tokens = 6
    want = offline.generate(
        [{"prompt": scene_prompt(q), "images": [s.render()]} if kind == "scene" else report_prompt(s, q)
         for kind, s, q in jobs], SamplingParams(max_tokens=tokens))
    urls = {id(s): png_data_url(s.render()) for s in scenes}

    async def worker(api, queue, results):
        while not queue.empty():
            i = queue.get_nowait()
            kind, subject, question = jobs[i]
            if kind == "scene":
                messages = [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": urls[id(subject)]}},
                    {"type": "text", "text": question}]}]
            else:
                messages = report_chat(subject, question)
            r = await api.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=tokens,
                                                  temperature=0, stream=i % 3 == 0)
            if i % 3 == 0:
                results[i] = "".join([c.choices[0].delta.content or "" async for c in r if c.choices])
            else:
                results[i] = r.choices[0].message.content

    async def run():
        queue = asyncio.Queue()
        for i in range(len(jobs)):
            queue.put_nowait(i)
        results = {}
        api = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=120)
        await asyncio.wait_for(asyncio.gather(*[worker(api, queue, results) for _ in range(32)]), 300)
        return results

    results = asyncio.run(run())
    assert [results[i] for i in range(len(jobs))] == [w.text for w in want]
    m = served.wait_idle()
    assert (m["mmkv_requests_running"], m["mmkv_requests_waiting"], m["mmkv_kv_blocks_in_use"]) == (0, 0, 0)
    served.engine.check_integrity()  # safe: no request in flight, the engine thread is idle


def test_echo_and_prompt_logprobs_are_the_engines(served, offline):
    """``echo`` with ``logprobs`` and ``max_tokens: 0`` (what lm-evaluation-harness sends for a
    multiple-choice item), echo before a completion, streamed echo, and vLLM's
    ``prompt_logprobs``: the prompt's logprobs are the offline engine's."""
    _, [report] = scenes_and_reports(6, 0, 1)
    prompt = report_prompt(report, REPORT_QUESTIONS[2])
    api = client(served)
    ids = offline.tokenizer.encode(prompt)
    want = offline.generate(prompt, SamplingParams(max_tokens=3, logprobs=2, prompt_logprobs=2))[0]
    texts = [offline.tokenizer.decode([i]) for i in ids]

    only = api.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    choice = only.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length" and only.usage.completion_tokens == 0
    assert choice.logprobs.tokens == texts and choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx([lp.logprob for lp in want.prompt_logprobs[1:]], abs=1e-5)
    assert choice.logprobs.top_logprobs[0] is None and len(choice.logprobs.top_logprobs[1]) == 2
    assert choice.logprobs.text_offset == [sum(map(len, texts[:i])) for i in range(len(texts))]

    both = api.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=3, temperature=0, echo=True, logprobs=2)
    choice = both.choices[0]
    assert choice.text == offline.tokenizer.decode(ids) + want.outputs[0].text
    assert choice.logprobs.token_logprobs[len(ids):] == pytest.approx([lp.logprob for lp in want.outputs[0].logprobs], abs=1e-5)
    assert len(choice.logprobs.text_offset) == len(ids) + 3

    streamed = api.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                      stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == prompt + want.outputs[0].text

    vllm = post(served, "/v1/completions", {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1,
                                            "prompt_logprobs": 2}).json()["choices"][0]
    scored = vllm["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(ids)
    for entry, lp in zip(scored[1:], want.prompt_logprobs[1:]):
        assert entry[str(lp.token_id)]["logprob"] == pytest.approx(lp.logprob, abs=1e-5)
        assert entry[str(lp.token_id)]["rank"] == lp.rank >= 1
    assert vllm["text"] == want.outputs[0].text[:len(vllm["text"])]

    refused = post(served, "/v1/completions", {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 0})
    assert refused.status_code == 400 and "max_tokens: 0 needs echo" in refused.json()["error"]["message"]
