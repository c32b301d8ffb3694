"""mmkv.distributed.answer on a local Ray cluster (2 CPUs, replicas on half a CPU each): answers
equal one local Engine's; with affinity each image is encoded once in the whole cluster and
documents keep more prefix hits, neither of which plain map_batches (measured in the same test) does not;
killing a replica mid-job loses and duplicates no row; bad rows come back with their error."""

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import ray

from mmkv import Engine, SamplingParams
from mmkv.bench.distributed_bench import ENGINE_OPTIONS, local_prompts, qa_rows
from mmkv.distributed import StatsBoard, answer

PARAMS = SamplingParams(max_tokens=8)
PREFIX = 32  # the reports are ~90 tokens: a longer prefix would include each row's instruction


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=256 * 1024**2, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def workload():
    """12 images x 8 questions and 4 documents x 6 instructions, shuffled, plus two bad rows,
    and what one local engine answers."""
    rows = qa_rows(0, 12, 8, 4, 6)
    bad = [{"id": len(rows), "question": "how many shapes are there?", "image": b"not an image", "prompt": None},
           {"id": len(rows) + 1, "question": None, "image": None, "prompt": None}]
    engine = Engine(**ENGINE_OPTIONS)
    outs = engine.generate(local_prompts(engine, rows), PARAMS, use_tqdm=False)
    engine.check_integrity()
    return rows + bad, {r["id"]: o.text for r, o in zip(rows, outs)}


def run(rows, board=None, params=PARAMS, **options):
    return answer(ray.data.from_items(rows, override_num_blocks=2), replicas=2, params=params,
                  engine_options=ENGINE_OPTIONS, num_cpus=0.5, stats=board,
                  affinity_prefix_tokens=PREFIX, **options)


def check_rows(out, rows, want):
    """Every input row exactly once; good rows answered as the local engine does, bad ones with
    their error and no answer."""
    assert sorted(r["id"] for r in out) == [r["id"] for r in rows]
    by_id = {r["id"]: r for r in out}
    for i, text in want.items():
        assert by_id[i]["error"] is None and by_id[i]["answer"] == text, i
    corrupt, empty = by_id[len(want)], by_id[len(want) + 1]
    assert corrupt["answer"] is None and "cannot be decoded" in corrupt["error"]
    assert empty["answer"] is None and "exactly one of 'prompt' and 'question'" in empty["error"]


def test_affinity_encodes_each_image_once_in_the_cluster(cluster, workload):
    rows, want = workload
    affine, plain = StatsBoard(), StatsBoard()
    out = run(rows, affine).take_all()
    check_rows(out, rows, want)
    assert affine.total("encoder_calls") == 12
    assert len(affine.snapshot()) == 2 and len({r["replica"] for r in out}) == 2
    cached = sum(r["cached_tokens"] for r in out)
    assert cached > 0

    out = run(rows, plain, affinity=False, batch_size=16).take_all()
    check_rows(out, rows, want)
    assert plain.total("encoder_calls") > 12
    assert sum(r["cached_tokens"] for r in out) < cached


def test_a_replica_killed_mid_job_loses_and_duplicates_no_row(cluster, workload):
    """A replica is killed (SIGKILL) while it answers a batch, found by the process title Ray
    gives a worker running a task. Rows go to replicas as they come (``affinity=False``): the
    restart and retry are the answering stage's, the same with affinity, and this path skips
    the keying stage's actors (a test this long is mostly actors starting)."""
    rows, want = workload
    killed: list[int] = []
    killer = threading.Thread(target=kill_first_busy_replica, args=(killed,), daemon=True)
    killer.start()
    out = run(rows, affinity=False, batch_size=8).take_all()
    killer.join(timeout=5)
    assert killed and not _alive(killed[0])  # it was busy, so its batch was retried
    check_rows(out, rows, want)


def kill_first_busy_replica(killed: list[int], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in os.listdir("/proc"):
            try:
                title = Path(f"/proc/{pid}/cmdline").read_bytes()
            except (OSError, ValueError):
                continue
            if b"MapBatches(_EngineReplica)).submit" in title:
                os.kill(int(pid), signal.SIGKILL)
                killed.append(int(pid))
                return
        time.sleep(0.01)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_bad_arguments_raise_before_anything_runs(cluster):
    ds = ray.data.from_items([{"prompt": "x"}])
    for options, message in (({"replicas": 0}, "replicas must be an integer >= 1"),
                             ({"params": {"max_tokens": 4}}, "params must be a SamplingParams"),
                             ({"model": "/nonexistent"}, "model must be a model directory"),
                             ({"affinity_prefix_tokens": 0}, "affinity_prefix_tokens must be"),
                             ({"partitions": 0}, "partitions must be an integer >= 1"),
                             ({"num_cpus": -1}, "num_cpus must be >= 0")):
        with pytest.raises(ValueError, match=message):
            answer(ds, **options)
