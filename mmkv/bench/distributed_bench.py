"""Batch Q&A on a local Ray cluster: mmkv.distributed.answer with image/prefix affinity against the
plain map_batches path (rows to replicas as they come, as Ray's own LLM processor sends them), and
both against one local Engine on the same rows.

Workload (bundled model, greedy): ``--images`` synthetic scenes x ``--questions`` questions each
and ``--documents`` city reports x ``--document-questions`` instructions each, in a shuffled order
(a table of questions, not grouped by image). Reported: ``distinct_images``; ``encoder_calls`` and
``kv_bytes_peak`` summed over the replicas, for both paths; ``cached_prompt_tokens`` for both and
against the single engine; wall time of both (each includes starting its replicas);
``outputs_equal`` (every answer of both paths equals the single engine's). The affinity key of a
report row is its first ``--affinity-prefix-tokens`` (32) tokens: the reports are ~90 tokens, so
the default 256 would cover each row's instruction and scatter a report's rows. On 2 cores the
wall time ratio is noisy (and the affinity path's includes its keying stage, shuffle and one more
actor's start); the counts are the point.
"""

from __future__ import annotations

import argparse
import io
import os
import random
import time
from typing import Any

from mmkv import Engine, SamplingParams
from mmkv.synthetic import document_prompt, random_report, random_scene, report_questions

SCENE_QUESTIONS = ("how many shapes are there?", "describe the scene.", "what is at the centre?",
                   "what is at the top left?", "is there a red circle?", "is there a blue square?",
                   "how many circles are there?", "how many squares are there?")
ENGINE_OPTIONS = {"kv_cache_memory": "64MiB", "host_kv_memory": "8MiB"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--images", type=int, default=12)
    p.add_argument("--questions", type=int, default=8, help=f"per image, at most {len(SCENE_QUESTIONS)}")
    p.add_argument("--documents", type=int, default=4)
    p.add_argument("--document-questions", type=int, default=6, help="per document, at most 6")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--cpus", type=float, default=os.cpu_count(), help="the local cluster's CPUs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--affinity-prefix-tokens", type=int, default=32,
                   help="the reports are ~90 tokens: 256 would include each row's instruction")


def qa_rows(seed: int, images: int, questions: int, documents: int, document_questions: int
            ) -> list[dict[str, Any]]:
    """Scene question rows (``question`` + PNG ``image``) and report instruction rows
    (``prompt``), each with an ``id``, shuffled."""
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    for _ in range(images):
        png = io.BytesIO()
        random_scene(rng).render().save(png, "PNG")
        rows += [{"question": q, "image": png.getvalue(), "prompt": None}
                 for q in SCENE_QUESTIONS[:questions]]
    for _ in range(documents):
        report = random_report(rng)
        rows += [{"question": None, "image": None, "prompt": document_prompt(report, qa.question)}
                 for qa in report_questions(report)[:document_questions]]
    rng.shuffle(rows)
    return [{"id": i, **row} for i, row in enumerate(rows)]


def local_prompts(engine: Engine, rows: list[dict[str, Any]]) -> list[Any]:
    """The rows as one local engine's prompts (what ``answer`` sends for each)."""
    from mmkv.distributed.batch import row_prompt  # Ray loads only when this bench runs

    return [row_prompt(engine, r["prompt"], r["question"], r["image"]) for r in rows]


def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    from mmkv.distributed import StatsBoard, answer

    rows = qa_rows(args.seed, args.images, args.questions, args.documents, args.document_questions)
    params = SamplingParams(max_tokens=args.max_tokens)
    engine = Engine(**ENGINE_OPTIONS)
    want = [o.text for o in engine.generate(local_prompts(engine, rows), params, use_tqdm=False)]
    single = engine.stats()
    ray.init(num_cpus=args.cpus, include_dashboard=False, object_store_memory=256 * 1024**2,
             log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    result: dict[str, Any] = {"rows": len(rows), "distinct_images": args.images}
    equal = True
    try:
        for label, affinity in (("_round_robin", False), ("", True)):  # the first pays Ray's warm-up
            board = StatsBoard()
            start = time.perf_counter()
            out = answer(ray.data.from_items(rows, override_num_blocks=2), replicas=args.replicas, params=params,
                         engine_options=ENGINE_OPTIONS, affinity=affinity,
                         affinity_prefix_tokens=args.affinity_prefix_tokens,
                         num_cpus=args.cpus / (args.replicas + 1), stats=board).take_all()
            result[f"wall_s{label}"] = round(time.perf_counter() - start, 2)
            got = {r["id"]: r["answer"] for r in out}
            equal &= len(out) == len(rows) and [got.get(i) for i in range(len(rows))] == want
            result[f"encoder_calls{label}"] = board.total("encoder_calls")
            result[f"cached_prompt_tokens{label}"] = sum(r["cached_tokens"] for r in out)
            result[f"kv_bytes_peak{label}"] = board.total("peak_kv_bytes")
            result[f"replicas_used{label}"] = len({r["replica"] for r in out})
    finally:
        ray.shutdown()
    result["cached_prompt_tokens_single_engine"] = single["cached_prompt_tokens"]
    result["encoder_calls_single_engine"] = single["encoder_calls"]
    result["cached_prompt_tokens_vs_single_engine"] = round(
        result["cached_prompt_tokens"] / max(1, single["cached_prompt_tokens"]), 3)
    result["speedup_affinity_vs_round_robin"] = round(result["wall_s_round_robin"] / result["wall_s"], 2)
    result["outputs_equal"] = equal
    return result
