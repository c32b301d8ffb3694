"""`mmkv serve` against hostile or careless clients: input work and image encoding off the engine
thread, a truthful `/health`, limits counted in sequences, bounded client priorities, explicit
`max_tokens` that must fit, errors that leak nothing, and a start a user can read."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from mmkv import Engine
from server_harness import MODEL_NAME, bundled_engine, start_server
from tiny_qwen_vl import build_qwen_vl

ROOT = Path(__file__).parent.parent


@pytest.fixture(scope="module")
def served():
    running = start_server(bundled_engine(max_num_seqs=8), max_waiting=4, max_body_bytes=32 * 2**20,
                           client_priority=(-5, 5))
    yield running
    running.stop()


def native_qwen2_5_vl(directory: Path) -> Path:
    """The Qwen2.5-VL test model with the released Qwen2.5-VL image processor's pixel limits
    (3,136 to 12,845,056), so a 1024x1024 image keeps its native 1036x1036 (74x74 patches of 14,
    1,369 tokens after the 2x2 merge), and positions for eight of them."""
    build_qwen_vl("qwen2_5_vl", directory)
    processor = json.loads((directory / "processor_config.json").read_text())
    processor["image_processor"]["size"] = {"shortest_edge": 3136, "longest_edge": 12845056}
    (directory / "processor_config.json").write_text(json.dumps(processor))
    config = json.loads((directory / "config.json").read_text())
    config["text_config"]["max_position_embeddings"] = 16384
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def qwen_served(tmp_path_factory):
    engine = Engine(native_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl_native")),
                    kv_cache_memory="32MiB", host_kv_memory="4MiB", max_num_batched_tokens=256)
    running = start_server(engine)
    yield running
    running.stop()


def gradient_png_url(shade: int, size: int = 1024) -> str:
    """A ``size`` x ``size`` PNG (a gradient, so the body stays small) distinct for each shade."""
    pixels = np.zeros((size, size, 3), dtype=np.uint8)
    pixels[..., 0] = np.arange(size)[:, None] * 255 // size
    pixels[..., 1] = shade
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


async def longest_gap_during(url: str, big: dict, path: str,
                             stream_tokens: int = 600) -> tuple[float, httpx.Response]:
    """The longest gap between a stream's tokens while ``big`` is answered, and its answer."""
    stream_body = {"model": MODEL_NAME, "prompt": "the report", "max_tokens": stream_tokens, "temperature": 0,
                   "ignore_eos": True, "stream": True}
    arrivals: list[float] = []
    started, answered = asyncio.Event(), asyncio.Event()
    async with httpx.AsyncClient(timeout=120) as client:
        async def stream() -> None:
            while not answered.is_set():  # streams one after another until the big one is answered
                async with client.stream("POST", f"{url}/v1/completions", json=stream_body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data:"):
                            arrivals.append(time.perf_counter())
                            started.set()
                arrivals.append(None)  # a new stream starts: no gap across the two

        streaming = asyncio.create_task(stream())
        await started.wait()
        await asyncio.sleep(0.2)
        sent = time.perf_counter()
        answer = await client.post(f"{url}{path}", json=big)
        done = time.perf_counter()
        answered.set()
        await streaming
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])
            if a is not None and b is not None and b >= sent and a <= done]
    return max(gaps), answer


def test_a_huge_prompt_is_refused_by_its_length_before_it_is_tokenized(served, monkeypatch):
    """A 15 MB prompt is refused by its length before the tokenizer sees it: tokenizing it would
    take seconds of a core, which on a small machine the engine thread would lose too (input work
    runs on the input threads: ``test_input_work_runs_on_the_input_threads``). A short prompt
    after it is tokenized as ever."""
    tokenizer = served.engine.preparer.tokenizer
    encode, seen = tokenizer.encode, []

    def recording(text, *args, **kwargs):
        seen.append(len(text))
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", recording)
    big = httpx.post(f"{served.url}/v1/completions", json={
        "model": MODEL_NAME, "prompt": "alpha bravo charlie " * 750_000, "max_tokens": 4}, timeout=60)
    assert big.status_code == 400 and "characters" in big.json()["error"]["message"]
    short = httpx.post(f"{served.url}/v1/completions", json={
        "model": MODEL_NAME, "prompt": "the report", "max_tokens": 2}, timeout=60)
    assert short.status_code == 200 and seen == [len("the report")], seen


def test_eight_large_images_encode_while_a_concurrent_stream_decodes(qwen_served, monkeypatch):
    """Eight 1024x1024 images at Qwen2.5-VL's native resolution (5,476 patches each) are encoded
    off the engine thread: engine steps that gave the concurrent stream tokens ran from start to
    end while an image was being encoded (none can when the engine thread runs the encoder), and
    the stream's longest gap stays under half the encoder's time for the eight, which all fall
    in one admission when the encoder runs there. The request's answer counts its eight
    encodings, as the encoder does."""
    engine = qwen_served.engine
    encoder, encodes, steps = engine.model.vision.encoder, [], []
    forward, step = encoder._forward, engine.step

    def timed_forward(inputs):
        start = time.perf_counter()
        out = forward(inputs)
        encodes.append((start, time.perf_counter(), inputs["pixel_values"].shape[0]))
        return out

    def timed_step():
        start = time.perf_counter()
        outputs = step()
        steps.append((start, time.perf_counter(), bool(outputs)))
        return outputs

    monkeypatch.setattr(encoder, "_forward", timed_forward)
    monkeypatch.setattr(engine, "step", timed_step)
    calls = engine.stats()["encoder_calls"]
    content = [{"type": "image_url", "image_url": {"url": gradient_png_url(30 * i)}} for i in range(8)]
    big = {"model": MODEL_NAME, "max_tokens": 4, "messages": [
        {"role": "user", "content": [*content, {"type": "text", "text": "describe them."}]}]}
    gap, answer = asyncio.run(longest_gap_during(qwen_served.url, big, "/v1/chat/completions", 4000))
    encoding = sum(end - start for start, end, _ in encodes)
    inside = sum(any(a < start and end < b for a, b, _ in encodes) for start, end, gave in steps if gave)
    print(f"images: longest gap {gap:.3f} s, encoding {encoding:.3f} s, "
          f"{inside} steps with tokens ran inside an encoding")
    assert answer.status_code == 200, answer.text
    assert [patches for _, _, patches in encodes] == [74 * 74] * 8
    assert answer.json()["usage"]["mmkv"]["images_encoded"] == 8
    assert engine.stats()["encoder_calls"] - calls == 8
    assert inside >= len(encodes)
    assert gap < encoding / 2, (gap, encoding)


def test_input_work_runs_on_the_input_threads(served, monkeypatch):
    """Tokenizing, the chat template and the images happen before the engine thread sees the
    request (it only queues what is prepared)."""
    where: list[str] = []
    prepare = served.engine.prepare_request

    def recording(*args, **kwargs):
        where.append(threading.current_thread().name)
        return prepare(*args, **kwargs)

    monkeypatch.setattr(served.engine, "prepare_request", recording)
    answer = httpx.post(f"{served.url}/v1/completions", json={"model": MODEL_NAME, "prompt": "the report",
                                                               "max_tokens": 2}, timeout=60)
    assert answer.status_code == 200
    assert where and all(name.startswith("mmkv-input") for name in where), where


def test_admission_counts_sequences_not_requests(served):
    """The limit is 8 running + 4 waiting sequences: 3 prompts x n=5 can never be admitted (400),
    and while a request holds 8 sequences, another of 3 x 2 finds no room (503)."""
    base = {"model": MODEL_NAME, "temperature": 0.5, "max_tokens": 4}
    never = httpx.post(f"{served.url}/v1/completions", json={**base, "prompt": ["a", "b", "c"], "n": 5},
                       timeout=60)
    assert never.status_code == 400 and "15 sequences" in never.json()["error"]["message"]

    async def crowd() -> list[int]:
        async with httpx.AsyncClient(timeout=60) as client:
            holding = asyncio.create_task(client.post(f"{served.url}/v1/completions", json={
                **base, "prompt": ["the report"] * 4, "n": 2, "max_tokens": 300, "ignore_eos": True}))
            await asyncio.sleep(0.3)
            second = await client.post(f"{served.url}/v1/completions",
                                       json={**base, "prompt": ["x", "y", "z"], "n": 2})
            return [second.status_code, (await holding).status_code]

    assert asyncio.run(crowd()) == [503, 200]


@pytest.mark.parametrize("priority, status", [(0, 200), (5, 200), (-5, 200), (6, 400), (-10**30, 400)])
def test_client_priorities_stay_within_the_operators_range(served, priority, status):
    answer = httpx.post(f"{served.url}/v1/completions", json={
        "model": MODEL_NAME, "prompt": "the report", "max_tokens": 2, "priority": priority}, timeout=60)
    assert answer.status_code == status, answer.text
    if status == 400:
        assert "allowed: -5 to 5" in answer.json()["error"]["message"]


def test_an_explicit_max_tokens_must_fit_after_the_prompt(served):
    """Over what fits after the prompt: a 400 naming both numbers; unset, the answer runs up to
    the context (chat) or to the default (completions)."""
    limit = served.engine.max_model_len
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match=rf"max_tokens is {limit}, but the prompt has \d+ "
                                                      rf"tokens and max_model_len is {limit}"):
        client.completions.create(model=MODEL_NAME, prompt="the report", max_tokens=limit)
    with pytest.raises(openai.BadRequestError, match="max_tokens is"):
        client.chat.completions.create(model=MODEL_NAME, max_tokens=limit,
                                       messages=[{"role": "user", "content": "the report"}])
    fits = client.completions.create(model=MODEL_NAME, prompt="the report", max_tokens=3)
    assert fits.usage.completion_tokens <= 3
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].finish_reason in ("stop", "length")


def test_deep_json_and_internal_errors_leak_nothing(served, monkeypatch):
    deep = httpx.post(f"{served.url}/v1/completions", content=b"[" * 200_000,
                      headers={"Content-Type": "application/json"}, timeout=60)
    assert deep.status_code == 400
    assert deep.json()["error"]["message"] == "the body is not valid JSON (or nests too deeply)"

    def broken(*args, **kwargs):
        raise RuntimeError("secret internals at 0x7f00")

    monkeypatch.setattr(served.engine, "prepare_request", broken)
    failed = httpx.post(f"{served.url}/v1/completions",
                        json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2}, timeout=60)
    assert failed.status_code == 500
    assert "secret" not in failed.text and "0x7f" not in failed.text


def test_models_can_be_retrieved_by_id(served):
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("another-model")


def test_health_needs_no_key_and_turns_503_while_the_engine_is_stuck():
    """With an API key every route but /health refuses an anonymous client; /health answers
    without engine work, and is 503 while one engine step has run longer than the stall bound."""
    engine = bundled_engine()
    running = start_server(engine, api_key="k3y", stall_seconds=0.3)
    try:
        assert httpx.get(f"{running.url}/health").status_code == 200
        assert httpx.get(f"{running.url}/metrics").status_code == 401
        assert httpx.get(f"{running.url}/v1/models").status_code == 401
        step, release = engine.step, threading.Event()

        def stuck():
            release.wait(10)
            return step()

        engine.step = stuck
        body = {"model": MODEL_NAME, "prompt": "the report", "max_tokens": 2}
        sender = threading.Thread(target=httpx.post, args=(f"{running.url}/v1/completions",),
                                  kwargs={"json": body, "headers": running.headers, "timeout": 60})
        sender.start()
        deadline = time.monotonic() + 5
        while httpx.get(f"{running.url}/health").status_code == 200:
            assert time.monotonic() < deadline, "/health stayed 200 while the engine was stuck"
            time.sleep(0.05)
        release.set()
        sender.join(30)
        assert httpx.get(f"{running.url}/health").status_code == 200
    finally:
        running.stop()


def test_the_access_log_has_a_line_per_request_and_the_start_says_ready(caplog):
    caplog.set_level(logging.INFO, logger="mmkv.server")
    running = start_server(bundled_engine())
    try:
        usage = httpx.post(f"{running.url}/v1/completions",
                           json={"model": MODEL_NAME, "prompt": "the report", "max_tokens": 3},
                           timeout=60).json()["usage"]
        httpx.post(f"{running.url}/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=60)
    finally:
        running.stop()
    lines = [r.getMessage() for r in caplog.records if r.name == "mmkv.server.access"]
    # The default temperature samples, so the answer may end before max_tokens: the line must
    # agree with the response's own usage.
    expected = (f"POST /v1/completions 200 prompt={usage['prompt_tokens']} cached=0 "
                f"completion={usage['completion_tokens']} ")
    assert any(line.startswith(expected) for line in lines), (expected, lines)
    assert any(line.startswith("POST /v1/completions 404") for line in lines), lines
    assert "ready" in [r.getMessage() for r in caplog.records if r.name == "mmkv.server"]


def test_the_command_parses_its_flags_before_loading_torch():
    """`mmkv serve --help` and `mmkv --version` answer without importing torch, and every flag
    has help text."""
    script = ("import sys, contextlib, io\n"
              "from mmkv.cli import main\n"
              "for argv in (['serve', '--help'], ['--version']):\n"
              "    with contextlib.redirect_stdout(io.StringIO()) as out:\n"
              "        try: main(argv)\n"
              "        except SystemExit: pass\n"
              "    print(out.getvalue().splitlines()[-1] if out.getvalue() else '')\n"
              "print('torch' in sys.modules, 'transformers' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    lines = done.stdout.splitlines()
    assert lines[-1] == "False False", done.stdout + done.stderr
    assert lines[-2].startswith("mmkv ")
    import argparse

    from mmkv.cli import add_serve_arguments

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    missing = [a.dest for a in parser._actions if a.dest != "help" and not a.help]
    assert missing == []
