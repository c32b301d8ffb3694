"""mmkv.distributed.answer on a local Ray cluster (2 CPUs, replicas on half a CPU each): answers
equal one local Engine's, in input order; with affinity each image is encoded once in the whole
cluster, each image and document (named as the rows' shared prefix or not) stays on one replica
and documents keep more prefix hits, none of which round robin (measured in the same test) does;
killing a replica mid-job loses and duplicates no row; bad rows come back with their error; the
benchmark at a tiny size reports its figures."""

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import ray

from mmkv import Engine, SamplingParams
from mmkv.bench.__main__ import main as bench_main
from mmkv.bench.distributed_bench import ENGINE_OPTIONS, local_prompts, qa_rows
from mmkv.bundled import BUNDLED_MODEL
from mmkv.distributed import Replicas, answer

# One local Ray cluster at a time: the suite runs these modules in the same worker (ray_cluster).
pytestmark = pytest.mark.xdist_group("ray")

PARAMS = SamplingParams(max_tokens=8)


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    ray.data.DataContext.get_current().enable_progress_bars = False


@pytest.fixture(scope="module")
def workload():
    """12 images x 8 questions and 4 documents (~90-token reports) x 6 instructions, shuffled,
    the rows of two documents naming their report as ``shared_prefix`` and those of the other two
    not, plus three bad rows, and what one local engine answers."""
    rows = [{**row, "shared_prefix": None} if row["group"] in ("document-0", "document-1") else row
            for row in qa_rows(0, 12, 8, 4, 6)]
    bad = [{"id": len(rows), "question": "how many shapes are there?", "image": b"not an image",
            "prompt": None, "shared_prefix": None, "group": None},
           {"id": len(rows) + 1, "question": None, "image": None, "prompt": None, "shared_prefix": None,
            "group": None},
           {"id": len(rows) + 2, "question": None, "image": None, "prompt": "a report. instruction: x",
            "shared_prefix": "another report.", "group": None}]
    engine = Engine(**ENGINE_OPTIONS)
    outs = engine.generate(local_prompts(engine, rows), PARAMS, use_tqdm=False)
    engine.check_integrity()
    return rows + bad, {r["id"]: o.text for r, o in zip(rows, outs)}


def fresh_replicas(num_cpus: float = 0.5) -> Replicas:
    """Two replicas on half a CPU each (a CPU stays free for Ray Data), their engines built."""
    replicas = Replicas(n=2, engine_options=ENGINE_OPTIONS, num_cpus=num_cpus)
    replicas.ready()
    return replicas


def run(replicas, rows, params=PARAMS, **options):
    return answer(ray.data.from_items(rows, override_num_blocks=4), replicas, params, **options).take_all()


def check_rows(out, rows, want):
    """Every input row exactly once; good rows answered as the local engine does, bad ones with
    their error and no answer."""
    assert sorted(r["id"] for r in out) == [r["id"] for r in rows]
    by_id = {r["id"]: r for r in out}
    for i, text in want.items():
        assert by_id[i]["error"] is None and by_id[i]["answer"] == text, i
    corrupt, empty, unshared = by_id[len(want)], by_id[len(want) + 1], by_id[len(want) + 2]
    assert corrupt["answer"] is None and "cannot be decoded" in corrupt["error"]
    assert empty["answer"] is None and "exactly one of 'prompt' and 'question'" in empty["error"]
    assert unshared["answer"] is None
    assert "'shared_prefix' must be a string that its 'prompt' starts with" in unshared["error"]


def replicas_per_group(out) -> dict[str, set[str]]:
    """Each image's and each document's replicas (the good rows only)."""
    groups: dict[str, set[str]] = {}
    for r in out:
        if r["error"] is None:
            groups.setdefault(r["group"], set()).add(r["replica"])
    return groups


def test_affinity_encodes_each_image_once_in_the_cluster(cluster, workload):
    rows, want = workload
    with fresh_replicas() as replicas:
        out = run(replicas, rows)
        check_rows(out, rows, want)
        assert [r["id"] for r in out] == [r["id"] for r in rows]  # in input order
        assert replicas.stats.total("encoder_calls") == 12
        assert len(replicas.stats.snapshot()) == 2 and len({r["replica"] for r in out}) == 2
    # a report with its instruction is shorter than the 256 tokens a route reads: the rows that
    # do not name their report stay on one replica because the report is their longest prefix held
    groups = replicas_per_group(out)
    assert len(groups) == 16 and all(len(replicas) == 1 for replicas in groups.values())
    cached = sum(r["cached_tokens"] for r in out)
    assert cached > 0

    with fresh_replicas() as replicas:
        out = run(replicas, rows, affinity=False, batch_size=8)
        check_rows(out, rows, want)
        assert replicas.stats.total("encoder_calls") > 12
    assert sum(r["cached_tokens"] for r in out) < cached
    assert any(len(replicas) > 1 for replicas in replicas_per_group(out).values())


def test_a_replica_killed_mid_job_loses_and_duplicates_no_row(cluster, workload):
    """A replica is killed (SIGKILL) once it has worked for a while on the job and before the job
    is done: Ray restarts it and sends its calls again, the other replica finds it again by name,
    and every row comes out once, answered as the local engine does."""
    rows, want = workload
    with fresh_replicas() as replicas:
        name = ray.get(replicas.actors[1].ready.remote())
        victim = int(name.rsplit("-", 1)[1])
        done: dict = {}
        job = threading.Thread(target=lambda: done.update(out=run(replicas, rows)), daemon=True)
        idle = cpu_seconds(victim)
        job.start()
        deadline = time.monotonic() + 60
        while cpu_seconds(victim) - idle < 0.1 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert job.is_alive()  # killed mid-job
        os.kill(victim, signal.SIGKILL)
        job.join(timeout=120)
        check_rows(done["out"], rows, want)
        incarnations = [n for n in replicas.stats.snapshot() if n.startswith(replicas.names[1])]
        assert len(incarnations) == 2  # the replica was restarted


def cpu_seconds(pid: int) -> float:
    """The CPU time process ``pid`` has used (user + system)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_bad_arguments_raise_before_anything_runs(cluster):
    for options, message in (({"n": 0}, "n must be an integer >= 1"),
                             ({"model": "/nonexistent"}, "model must be a model directory"),
                             ({"num_cpus": -1}, "num_cpus must be >= 0")):
        with pytest.raises(ValueError, match=message):
            Replicas(**options)
    ds = ray.data.from_items([{"prompt": "x"}])
    with pytest.raises(ValueError, match="replicas must be open Replicas"):
        answer(ds, 2)
    # every CPU of the cluster, the replicas not yet placed (the cluster still shows its CPUs free)
    with Replicas(n=2, engine_options=ENGINE_OPTIONS, num_cpus=1.0) as replicas:
        for options, message in (({"params": {"max_tokens": 4}}, "params must be a SamplingParams"),
                                 ({"affinity_prefix_tokens": 0}, "affinity_prefix_tokens must be"),
                                 ({"batch_size": 0}, "batch_size must be an integer >= 1"),
                                 ({}, "the replicas reserve 2 of the cluster's 2 CPUs")):
            with pytest.raises(ValueError, match=message):
                answer(ds, replicas, **options)
    # a CPU held by other work leaves none free beside one replica on half of one
    holder = CPUHolder.remote()
    try:
        ray.get(holder.ready.remote())
        with Replicas(n=1, engine_options=ENGINE_OPTIONS, num_cpus=0.5) as replicas:
            raised = within(60, lambda: answer(ds, replicas))  # unchecked, Ray Data would wait forever
            assert isinstance(raised, ValueError) and "none left beside the replicas" in str(raised)
    finally:
        ray.kill(holder)


def within(seconds: float, call):
    """What ``call()`` raised (None if nothing), failing the test if it has not returned in time."""
    raised = []

    def run():
        try:
            call()
        except Exception as err:  # handed to the caller
            raised.append(err)
        else:
            raised.append(None)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert raised, f"did not return within {seconds} s"
    return raised[0]


@ray.remote(num_cpus=1)
class CPUHolder:
    def ready(self) -> bool:
        return True


def test_the_benchmark_reports_every_figure_at_a_tiny_size(cluster, capsys):
    bench_main(["distributed", "--images", "2", "--questions", "2", "--documents", "1",
                "--document-questions", "2", "--max-tokens", "4", "--repeats", "1", "--cpus", "2",
                "--no-warm-up", "--json"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["outputs_equal"] is True and result["rows"] == 6
    assert result["encoder_calls"] == result["distinct_images"] == 2
    assert result["documents_on_several_replicas"] == result["images_on_several_replicas"] == 0
    for key in ("startup_seconds", "keying_seconds", "seconds", "seconds_round_robin",
                "speedup_affinity_vs_round_robin"):
        assert result[key] > 0, key
    assert ray.is_initialized()  # the test's cluster was used and left running


def test_run_batch_on_two_replicas_keeps_each_image_on_one(cluster):
    """``mmkv run-batch --ray-replicas 2``: the same results as one engine, line for line in
    order, each scene encoded once across the replicas (its lines all ran on one)."""
    from mmkv.distributed.batch import run_batch_on_replicas
    from mmkv.server.batch_file import run_batch
    from server_harness import bundled_engine
    from test_run_batch import _lines

    lines, _ = _lines(seed=2)
    local = run_batch(bundled_engine(), lines, progress=False)
    spread = run_batch_on_replicas(str(BUNDLED_MODEL), 2, {"kv_cache_memory": "32MiB", "host_kv_memory": "4MiB"},
                                   lines, progress=False)
    assert [r["custom_id"] for r in spread] == [r["custom_id"] for r in local]

    def answer(result):
        response = result["response"]
        if response is None or response["status_code"] != 200:
            return None if response is None else response["body"]["error"]["message"]
        choice = response["body"]["choices"][0]
        return choice.get("message", {}).get("content", choice.get("text"))

    assert [answer(r) for r in spread] == [answer(r) for r in local]
    encoded = sum(r["response"]["body"]["usage"]["mmkv"]["images_encoded"] for r in spread
                  if r["response"] is not None and r["response"]["status_code"] == 200)
    assert encoded == 2
