"""`mmkv serve` against `transformers serve --continuous-batching`: the same model directory and the
same client workload, one server after the other, through the openai async client on
/v1/completions (streamed).

Model: the benchmarks' random Llama (hidden 512, 8 layers) with the bundled byte-level BPE
tokenizer (vocabulary 1024), fp32 on the CPU. Workload: 8 documents of ~500 tokens x 8 questions
each, 16 concurrent streams, 32 greedy tokens each. Reported per server as `vllm bench serve`
does: request throughput, output tokens/s, TTFT p50/p99, TPOT p50, E2E latency p50; and the
ratios `throughput_vs_transformers_serve`, `ttft_p99_vs_transformers_serve`. `outputs_equal`:
every answer identical on both servers (``python -m mmkv.bench`` exits non-zero otherwise). The peer needs
transformers' serving extra and accelerate (in mmkv's `dev` extra).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import httpx

from mmkv.bench.random_models import save_random_llama
from mmkv.bundled import BUNDLED_MODEL
from mmkv.synthetic import DOCUMENT_TEMPLATE, random_report, report_questions

EXTRA_QUESTIONS = ("what is the report about?", "name one fact from the report.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--documents", type=int, default=8)
    p.add_argument("--questions", type=int, default=8, help="per document")
    p.add_argument("--document-tokens", type=int, default=500)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--startup-timeout", type=float, default=600)


class Result(NamedTuple):
    text: str
    ttft: float
    e2e: float
    tokens: int


def save_model(directory: Path) -> Path:
    save_random_llama(directory, vocab_size=1024, bos_token_id=None, eos_token_id=1, pad_token_id=0)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED_MODEL / name, directory / name)
    return directory


def workload(documents: int, questions: int, document_tokens: int, seed: int = 0) -> list[str]:
    """``documents`` x ``questions`` prompts: a document of about ``document_tokens`` tokens (city
    reports joined), an instruction, ``answer:``."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(BUNDLED_MODEL)
    rng = random.Random(seed)
    prompts = []
    for _ in range(documents):
        reports = [random_report(rng)]
        while len(tokenizer.encode(" ".join(r.text for r in reports))) < document_tokens:
            reports.append(random_report(rng))
        document = " ".join(r.text for r in reports)
        asked = [qa.question for qa in report_questions(reports[0])] + list(EXTRA_QUESTIONS)
        prompts += [DOCUMENT_TEMPLATE.format(document=document, question=q) for q in asked[:questions]]
    return prompts


def warm_up_prompt(document_tokens: int, seed: int = 0) -> str:
    """A prompt of the workload's kind that shares no document with ``workload(..., seed)``'s
    (drawn from another seed): the warm-up request leaves nothing in the cache that the timed
    requests could read."""
    return workload(1, 1, document_tokens, seed + 1)[0]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(command: list[str], url: str, timeout: float) -> subprocess.Popen:
    """The server, its output to a temporary file (a pipe nobody reads would fill and stall it)."""
    log = tempfile.TemporaryFile("w+")
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            log.seek(0)
            raise RuntimeError(f"{command[:4]} did not start: {log.read()[-2000:]}")
        time.sleep(0.5)


def stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


async def drive(url: str, model: str, prompts: list[str], warm_up: str, concurrency: int,
                max_tokens: int, usage_option: bool) -> tuple[list[Result], float]:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    gate = asyncio.Semaphore(concurrency)
    extra = {"stream_options": {"include_usage": True}} if usage_option else {}

    async def one(prompt: str) -> Result:
        async with gate:
            start_time = time.perf_counter()
            ttft, text, tokens = None, [], 0
            stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                                     temperature=0, stream=True, **extra)
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    ttft = ttft if ttft is not None else time.perf_counter() - start_time
                    text.append(chunk.choices[0].text)
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            return Result("".join(text), ttft or 0.0, time.perf_counter() - start_time, tokens)

    await one(warm_up)  # the first request pays one-time costs on both servers
    begin = time.perf_counter()
    results = await asyncio.gather(*[one(p) for p in prompts])
    return list(results), time.perf_counter() - begin


def _settled(text: str) -> str:
    """The text without a trailing incomplete character: an answer cut by ``max_tokens`` inside a
    multi-byte character ends in U+FFFD in mmkv's (and OpenAI's) final text, while transformers
    serve's streamer never sends those bytes."""
    return text.rstrip("\ufffd")


def figures(results: list[Result], seconds: float) -> dict[str, float]:
    ttfts = sorted(r.ttft for r in results)
    tpots = [(r.e2e - r.ttft) / (r.tokens - 1) for r in results if r.tokens > 1]
    return {"request_throughput": round(len(results) / seconds, 3),
            "output_tokens_per_s": round(sum(r.tokens for r in results) / seconds, 1),
            "ttft_p50_ms": round(1000 * statistics.median(ttfts), 1),
            "ttft_p99_ms": round(1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 1),
            "tpot_p50_ms": round(1000 * statistics.median(tpots), 2) if tpots else 0.0,
            "e2e_p50_ms": round(1000 * statistics.median(r.e2e for r in results), 1),
            "seconds": round(seconds, 2)}


def serve_and_drive(name: str, command: list[str], url: str, model: str, prompts: list[str],
                    warm_up: str, args: argparse.Namespace) -> tuple[list[Result], float]:
    process = start(command, url, args.startup_timeout)
    try:
        return asyncio.run(drive(url, model, prompts, warm_up, args.concurrency, args.max_tokens,
                                 usage_option=name == "mmkv"))
    finally:
        stop(process)


def run(args: argparse.Namespace) -> dict:
    prompts = workload(args.documents, args.questions, args.document_tokens)
    warm_up = warm_up_prompt(args.document_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        model = str(save_model(Path(tmp) / "llama"))
        port = free_port()
        mmkv_cmd = [sys.executable, "-m", "mmkv", "serve", model, "--port", str(port),
                    "--served-model-name", model, "--kv-cache-memory", "512MiB", "--host-kv-memory", "64MiB",
                    "--device", "cpu", "--dtype", "float32", "--log-level", "warning"]
        ours, our_seconds = serve_and_drive("mmkv", mmkv_cmd, f"http://127.0.0.1:{port}", model,
                                            prompts, warm_up, args)
        port = free_port()
        peer_cmd = [str(Path(sys.executable).parent / "transformers"), "serve", model,
                    "--continuous-batching", "--host", "127.0.0.1", "--port", str(port),
                    "--device", "cpu", "--dtype", "float32", "--cb-num-blocks", "64", "--cb-max-batch-tokens", "2048", "--log-level", "error"]
        theirs, their_seconds = serve_and_drive("transformers", peer_cmd, f"http://127.0.0.1:{port}",
                                                model, prompts, warm_up, args)
    mine, peer = figures(ours, our_seconds), figures(theirs, their_seconds)
    equal = [_settled(r.text) for r in ours] == [_settled(r.text) for r in theirs]
    result = {
        "requests": len(prompts), "concurrency": args.concurrency, "max_tokens": args.max_tokens,
        "mmkv": mine, "transformers_serve": peer,
        "throughput_vs_transformers_serve": round(mine["request_throughput"] / peer["request_throughput"], 2),
        "ttft_p99_vs_transformers_serve": round(mine["ttft_p99_ms"] / peer["ttft_p99_ms"], 3),
        "outputs_equal": equal,
    }
    if not equal:
        differing = [i for i, (a, b) in enumerate(zip(ours, theirs)) if _settled(a.text) != _settled(b.text)]
        print(f"outputs differ on {len(differing)} of {len(prompts)} requests; the first, request "
              f"{differing[0]}: mmkv {ours[differing[0]].text!r}, transformers serve "
              f"{theirs[differing[0]].text!r}", file=sys.stderr)
    return result
