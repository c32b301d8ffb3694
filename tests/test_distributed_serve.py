"""`mmkv serve --replicas 2` on Ray Serve (a local 2-CPU cluster), driven by the openai client:
answers equal the offline engine's; the cache-aware router sends every question about one image
to one replica (8 images, 8 encoder calls in the cluster) and spreads a burst on one image over
both replicas once the queue threshold is crossed; /metrics sums and labels the replicas, /health
turns 503 when a replica is killed, and no block is in use after the run."""

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest
import ray
from ray import serve

from mmkv import SamplingParams
from mmkv.distributed import serve_app
from mmkv.cli import add_serve_arguments
from mmkv.synthetic import scene_prompt
from server_harness import (MODEL_NAME, REPORT_QUESTIONS, bundled_engine, free_socket, report_chat,
                            report_prompt, scene_chat, scenes_and_reports)

# One local Ray cluster at a time: the suite runs these modules in the same worker (ray_cluster).
pytestmark = pytest.mark.xdist_group("ray")

QUESTIONS = ("how many shapes are there?", "describe the scene.", "what is at the centre?",
             "what is at the top left?", "is there a red circle?", "how many circles are there?")
TOKENS = 8
THRESHOLD = 12  # the router's imbalance threshold; the first test never has more in flight
MAX_NUM_SEQS = 4  # a replica decodes at most 4 at a time, so a burst queues on it


@pytest.fixture(scope="module")
def url(ray_cluster):
    import argparse

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["--replicas", "2", "--replica-cpus", "0.5", "--kv-cache-memory", "32MiB",
                              "--host-kv-memory", "4MiB", "--served-model-name", MODEL_NAME,
                              "--route-imbalance-threshold", str(THRESHOLD),
                              "--max-num-seqs", str(MAX_NUM_SEQS)])
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(serve_app.build(args), name="mmkv", route_prefix="/")
    yield f"http://127.0.0.1:{port}"


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def idle_metrics(url: str, timeout: float = 20.0) -> dict[str, float]:
    """Metrics once every replica reported no request running or waiting and no block in use."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        busy = m["mmkv_requests_running"] + m["mmkv_requests_waiting"] + m["mmkv_kv_blocks_in_use"]
        if busy == 0 or time.monotonic() > deadline:
            time.sleep(0.6)  # two more heartbeats: the idle snapshot is the last one
            return metrics(url)
        time.sleep(0.1)


def per_replica(m: dict[str, float], name: str) -> dict[str, float]:
    prefix = f"{name}{{replica=\""
    return {k[len(prefix):-2]: v for k, v in m.items() if k.startswith(prefix)}


async def ask_all(url: str, jobs, concurrency: int, tokens: int = TOKENS,
                  ignore_eos: bool = False) -> list[str]:
    api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    gate = asyncio.Semaphore(concurrency)

    async def ask(scene, question):
        async with gate:
            r = await api.chat.completions.create(model=MODEL_NAME, messages=scene_chat(scene, question),
                                                  max_tokens=tokens, temperature=0,
                                                  extra_body={"ignore_eos": ignore_eos})
            return r.choices[0].message.content

    return await asyncio.gather(*(ask(s, q) for s, q in jobs))


def test_answers_equal_offline_and_each_image_is_encoded_once(url):
    scenes, _ = scenes_and_reports(3, 8, 0)
    jobs = [(s, q) for q in QUESTIONS for s in scenes]
    got = asyncio.run(ask_all(url, jobs, THRESHOLD))
    offline = bundled_engine()
    want = offline.generate([{"prompt": scene_prompt(q), "images": [s.render()]} for s, q in jobs],
                            SamplingParams(max_tokens=TOKENS), use_tqdm=False)
    assert got == [o.text for o in want]
    m = idle_metrics(url)
    assert m["mmkv_encoder_calls_total"] == 8
    assert m["mmkv_kv_blocks_in_use"] == 0
    assert sum(per_replica(m, "mmkv_replica_encoder_calls_total").values()) == 8
    assert len(per_replica(m, "mmkv_replica_kv_blocks_in_use")) == 2
    assert httpx.get(f"{url}/health").status_code == 200


def test_a_burst_on_one_image_spreads_over_both_replicas(url):
    before = per_replica(metrics(url), "mmkv_replica_prompt_tokens_total")
    scenes, _ = scenes_and_reports(4, 1, 0)
    # Every answer runs its 100 tokens (no early end of text) and a replica decodes MAX_NUM_SEQS
    # at a time, so the key's replica finishes 4 answers per 100 decoding steps while the burst
    # sends 48 at once: its queue passes the threshold whatever the machine's speed.
    burst = [(scenes[0], QUESTIONS[i % 6]) for i in range(4 * THRESHOLD)]
    asyncio.run(ask_all(url, burst, len(burst), tokens=100, ignore_eos=True))
    after = per_replica(idle_metrics(url), "mmkv_replica_prompt_tokens_total")
    assert len(after) == 2 and all(after[r] > before.get(r, 0) for r in after), (before, after)


def test_tokenize_reaches_the_replica_that_holds_the_prompt(url):
    """``/tokenize`` goes where a request with the prompt would go: after a chat about a report
    ran (keyed by the report, its system message), the same report with another question shows
    the shared prefix cached there, whichever of the two replicas that is; so do completions of
    reports that name no shared part (routed by the longest prefix a replica holds)."""
    _, reports = scenes_and_reports(5, 0, 4)
    api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    api.chat.completions.create(model=MODEL_NAME, messages=report_chat(reports[0], "who is the mayor?"), max_tokens=2)
    done = httpx.post(f"{url}/tokenize", json={"messages": report_chat(reports[0], "when was it founded?")}).json()
    assert done["count"] == len(done["tokens"]) and done["cached_tokens"] > 0
    for report in reports[1:]:
        api.completions.create(model=MODEL_NAME, prompt=report_prompt(report, REPORT_QUESTIONS[1]), max_tokens=2)
        done = httpx.post(f"{url}/tokenize", json={"prompt": report_prompt(report, REPORT_QUESTIONS[2])}).json()
        assert done["cached_tokens"] > 0
    with pytest.raises(httpx.HTTPStatusError, match="400"):
        httpx.post(f"{url}/tokenize", json={"prompt": [5] * 5000}).raise_for_status()


def test_refused_requests_get_400_with_the_reason(url):
    """A corrupt image (refused by the ingress) and a prompt over max_model_len (refused by the
    replica's engine, its ValueError crossing Ray unwrapped)."""
    api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="is not a readable image"):
        api.chat.completions.create(model=MODEL_NAME, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}},
            {"type": "text", "text": "what is it?"}]}])
    limit = httpx.get(f"{url}/v1/models").json()["data"][0]["max_model_len"]
    with pytest.raises(openai.BadRequestError, match=f"max_model_len is {limit}"):
        api.completions.create(model=MODEL_NAME, prompt=[5] * (limit + 1), max_tokens=4)
    assert idle_metrics(url)["mmkv_kv_blocks_in_use"] == 0


def test_health_fails_while_a_replica_is_down(url):
    """Runs last: a replica killed (SIGKILL) stops reporting, and /health turns 503. The replicas
    are this test process's descendants: another test run's cluster on the machine is left alone."""
    assert httpx.get(f"{url}/health").status_code == 200
    replica = b"ray::ServeReplica:mmkv:EngineReplica"  # the process title Ray gives a replica
    pids = [int(p) for p in os.listdir("/proc")
            if p.isdigit() and _title(p).startswith(replica) and _descends_from(p, os.getpid())]
    assert len(pids) == 2
    os.kill(pids[0], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while httpx.get(f"{url}/health").status_code == 200:
        assert time.monotonic() < deadline, "/health stayed 200 with a replica dead"
        time.sleep(0.2)


def _descends_from(pid: str, ancestor: int) -> bool:
    """Whether process ``pid`` is a descendant of process ``ancestor`` (this cluster's raylet and
    its workers are the test process's: ``ray.init`` started them)."""
    while pid not in ("0", "1"):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = stat.rsplit(")", 1)[1].split()[1]  # the parent's id follows the state
        if int(pid) == ancestor:
            return True
    return False


def _title(pid: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
