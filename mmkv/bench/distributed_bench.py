"""Batch Q&A on a local Ray cluster: mmkv.distributed.answer with image/prefix affinity against
round robin (``affinity=False``: a block's rows in batches of ``--batch-size`` to the replicas in
turn, whatever each replica is busy with), and both against one local Engine on the same rows.

Workload (bundled model, greedy): ``--images`` synthetic scenes x ``--questions`` questions each
and ``--documents`` city reports x ``--document-questions`` instructions each (a report row names
its report as its ``shared_prefix``, unless ``--no-shared-prefix``: then the router must find the
report itself), shuffled: a table of questions, not grouped by image. The defaults make 1,040
rows on 2 replicas.

Ray is started, and one uncounted pass of each side run on other images and reports
(``--no-warm-up`` skips it), before anything is timed. Then the two sides take turns for
``--repeats`` rounds (the first side of a round alternates). Each pass builds fresh replicas
(``mmkv.distributed.Replicas``) and waits until every engine is up (``startup_seconds``) before its
clock starts: ``seconds`` is the answering alone, from the first row read to the last answer, with
keying included on the affinity side; ``keying_seconds`` is what keying every row costs in one
process. A side's figures are the medians of its passes; ``speedup_affinity_vs_round_robin`` is the
median over rounds of each round's ratio (round robin's seconds over affinity's). Reported with
them: ``rows``, ``distinct_images``; ``encoder_calls``, ``cached_prompt_tokens`` and
``kv_bytes_peak`` summed over the replicas for both sides and for the single engine;
``documents_on_several_replicas`` and ``images_on_several_replicas`` (how many reports and images
had rows answered on more than one replica: each of them was prefilled or encoded more than once);
``outputs_equal`` (every answer of every pass equals the single engine's).
"""

from __future__ import annotations

import argparse
import io
import os
import random
import statistics
import time
from typing import Any

from mmkv import Engine, SamplingParams
from mmkv.distributed.affinity import DEFAULT_PREFIX_TOKENS
from mmkv.synthetic import document_prompt, random_report, random_scene, report_questions

SCENE_QUESTIONS = ("how many shapes are there?", "describe the scene.", "what is at the centre?",
                   "what is at the top left?", "is there a red circle?", "is there a blue square?",
                   "how many circles are there?", "how many squares are there?")
ENGINE_OPTIONS = {"kv_cache_memory": "64MiB", "host_kv_memory": "8MiB"}
SIDES = {"round_robin": False, "affinity": True}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--images", type=int, default=100)
    p.add_argument("--questions", type=int, default=8, help=f"per image, at most {len(SCENE_QUESTIONS)}")
    p.add_argument("--documents", type=int, default=40)
    p.add_argument("--document-questions", type=int, default=6, help="per document, at most 6")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64,
                   help="rows per input block, and per batch that round robin sends")
    p.add_argument("--cpus", type=float, default=os.cpu_count(), help="the local cluster's CPUs")
    p.add_argument("--repeats", type=int, default=2, help="counted rounds of both sides")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warm-up", action=argparse.BooleanOptionalAction, default=True,
                   help="an uncounted pass of each side on other rows first")
    p.add_argument("--shared-prefix", action=argparse.BooleanOptionalAction, default=True,
                   help="report rows name their report as their shared_prefix")


def qa_rows(seed: int, images: int, questions: int, documents: int, document_questions: int,
            shared_prefix: bool = True) -> list[dict[str, Any]]:
    """Scene question rows (``question`` + PNG ``image``) and report instruction rows
    (``prompt``, with the report as its ``shared_prefix`` if ``shared_prefix``), each with an
    ``id`` and its ``group`` (``image-k`` or ``document-k``), shuffled."""
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    for k in range(images):
        png = io.BytesIO()
        random_scene(rng).render().save(png, "PNG")
        rows += [{"question": q, "image": png.getvalue(), "prompt": None, "shared_prefix": None,
                  "group": f"image-{k}"} for q in SCENE_QUESTIONS[:questions]]
    for k in range(documents):
        report = random_report(rng)
        rows += [{"question": None, "image": None, "prompt": document_prompt(report, qa.question),
                  "shared_prefix": report.text if shared_prefix else None, "group": f"document-{k}"}
                 for qa in report_questions(report)[:document_questions]]
    rng.shuffle(rows)
    return [{"id": i, **row} for i, row in enumerate(rows)]


def local_prompts(engine: Engine, rows: list[dict[str, Any]]) -> list[Any]:
    """The rows as one local engine's prompts (what ``answer`` sends for each)."""
    from mmkv.distributed.batch import row_prompt  # Ray loads only when this bench runs

    return [row_prompt(engine, r["prompt"], r["question"], r["image"]) for r in rows]


def one_pass(rows: list[dict[str, Any]], affinity: bool, params: SamplingParams,
             args: argparse.Namespace) -> tuple[dict[str, Any], dict[int, str]]:
    """Answer ``rows`` once on fresh replicas, built and ready before the clock starts: the
    pass's figures and each row's answer."""
    import ray

    from mmkv.distributed import Replicas, answer

    with Replicas(n=args.replicas, engine_options=ENGINE_OPTIONS,
                  num_cpus=(args.cpus - 1) / args.replicas) as replicas:  # a CPU for Ray Data
        startup = replicas.ready()
        start = time.perf_counter()
        ds = ray.data.from_items(rows, override_num_blocks=max(2, -(-len(rows) // args.batch_size)))
        out = answer(ds, replicas, params, affinity=affinity, batch_size=args.batch_size).take_all()
        seconds = time.perf_counter() - start
        board = replicas.stats
        figures = {"startup_seconds": startup, "seconds": seconds,
                   "encoder_calls": board.total("encoder_calls"),
                   "cached_prompt_tokens": sum(r["cached_tokens"] for r in out),
                   "kv_bytes_peak": board.total("peak_kv_bytes"),
                   "replicas_used": len({r["replica"] for r in out}), "rows_out": len(out),
                   **groups_on_several_replicas(out)}
    return figures, {r["id"]: r["answer"] for r in out}


def groups_on_several_replicas(out: list[dict[str, Any]]) -> dict[str, int]:
    """How many documents and how many images had rows answered on more than one replica."""
    replicas: dict[str, set[str]] = {}
    for r in out:
        replicas.setdefault(r["group"], set()).add(r["replica"])
    several = [group.split("-")[0] for group, where in replicas.items() if len(where) > 1]
    return {f"{kind}s_on_several_replicas": several.count(kind) for kind in ("document", "image")}


def keying_seconds(rows: list[dict[str, Any]], prefix_tokens: int) -> float:
    """What keying every row costs in one process (reading each image and hashing its pixels,
    hashing each shared prefix): the affinity path's own work, spread over the replicas."""
    import pandas as pd
    from transformers import AutoTokenizer

    from mmkv.bundled import BUNDLED_MODEL
    from mmkv.distributed.rows import AffinityKeys

    keys = AffinityKeys(AutoTokenizer.from_pretrained(BUNDLED_MODEL), prefix_tokens)
    start = time.perf_counter()
    keys(pd.DataFrame(rows))
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    rows = qa_rows(args.seed, args.images, args.questions, args.documents, args.document_questions,
                   args.shared_prefix)
    # other images and reports than the workload's
    warm_up = qa_rows(args.seed + 1, 2, 2, 1, 2, args.shared_prefix)
    params = SamplingParams(max_tokens=args.max_tokens)
    engine = Engine(**ENGINE_OPTIONS)
    start = time.perf_counter()
    want = [o.text for o in engine.generate(local_prompts(engine, rows), params, use_tqdm=False)]
    single_seconds = time.perf_counter() - start
    single = engine.stats()
    del engine
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(num_cpus=args.cpus, include_dashboard=False, object_store_memory=256 * 1024**2,
                 log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    passes: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    keying = keying_seconds(rows, DEFAULT_PREFIX_TOKENS)
    equal = True
    try:
        for side, affinity in SIDES.items() if args.warm_up else ():
            one_pass(warm_up, affinity, params, args)
        for round_ in range(args.repeats):
            for side in (list(SIDES) if round_ % 2 == 0 else list(SIDES)[::-1]):
                figures, answers = one_pass(rows, SIDES[side], params, args)
                equal &= figures.pop("rows_out") == len(rows) and [
                    answers.get(i) for i in range(len(rows))] == want
                passes[side].append(figures)
    finally:
        if started_ray:
            ray.shutdown()
    images = {r["image"] for r in rows if r["image"] is not None}  # two scenes may draw alike
    result: dict[str, Any] = {"rows": len(rows), "distinct_images": len(images),
                              "shared_prefix_named": args.shared_prefix,
                              "replicas": args.replicas, "single_engine_seconds": round(single_seconds, 2)}
    for side, figures in passes.items():
        suffix = "" if SIDES[side] else "_round_robin"
        for key in figures[0]:
            result[f"{key}{suffix}"] = round(statistics.median(f[key] for f in figures), 3)
    result["keying_seconds"] = round(keying, 3)
    result["startup_seconds"] = round(statistics.median(
        f["startup_seconds"] for side in passes.values() for f in side), 2)
    result["speedup_affinity_vs_round_robin"] = round(statistics.median(
        rr["seconds"] / aff["seconds"] for rr, aff in zip(passes["round_robin"], passes["affinity"])), 3)
    result["encoder_calls_single_engine"] = single["encoder_calls"]
    result["cached_prompt_tokens_single_engine"] = single["cached_prompt_tokens"]
    result["cached_prompt_tokens_vs_single_engine"] = round(
        result["cached_prompt_tokens"] / max(1, single["cached_prompt_tokens"]), 3)
    result["outputs_equal"] = equal
    return result
