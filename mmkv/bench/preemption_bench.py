"""Preemption policies under memory pressure: ``cost`` against ``newest`` over pool sizes and modes.

A random Llama (hidden 512, 8 layers, fp32) serves a workload (``--workload``) arriving one
request every ``--every`` engine steps in an order drawn from ``--seed``: ``long-short`` mixes
``--long`` requests with long prompts and short answers and ``--short`` requests with short prompts
and long answers; ``mixed-lengths`` mixes 10 prompts of 270-330 tokens with 4-16-token answers
and 10 of 24-36 tokens with 120-200-token answers. A cell is one device pool of ``--kv-blocks``
(only a pool below what the workload holds at its peak preempts) and one preemption mode of ``--preemption``, with a host tier
of ``--host-blocks``. In each cell both policies serve the same arrivals on fresh engines,
alternating for ``--repeats`` rounds (which one goes first alternates from cell to cell too; the
first run of the process, uncounted, settles it); each figure is the median of its policy's
rounds. Greedy outputs must be equal across every run (preemption never changes an output).

Per cell and policy: seconds (first arrival to last output), ``recomputed_tokens`` (tokens
computed again at positions a sequence had computed before it was preempted), ``swapped_bytes``,
preemptions by kind, request latency p50/p99 (arrival to last token) and the most preemptions of
one request; ``recomputed_tokens_cost_vs_newest`` and ``swapped_bytes_cost_vs_newest``, ratios of
the medians, and ``seconds_cost_vs_newest``, the median over rounds of each round's ratio (the two
runs of a round are seconds apart, so the machine's drift between rounds cancels). Over the cells:
the least and the most ``seconds_cost_vs_newest``, and the restore speeds the engines measured.
Each cell's figures go to stderr as one JSON line when it is done.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from mmkv import Engine, SamplingParams
from mmkv.bench import gc_paused
from mmkv.bench.random_models import BENCH_LLAMA, save_random_llama, text_size
from mmkv.preemption import POLICIES, CostWeights
from mmkv.scheduler import PREEMPTION_MODES

BLOCK = 16


WORKLOADS = ("long-short", "mixed-lengths")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", choices=WORKLOADS, default="long-short",
                   help="long-short: the sizes below; mixed-lengths: 10 prompts of 270-330 tokens "
                        "with 4-16-token answers and 10 of 24-36 tokens with 120-200-token answers")
    p.add_argument("--long", type=int, default=10, help="requests with a long prompt")
    p.add_argument("--long-prompt", type=int, default=1024)
    p.add_argument("--long-answer", type=int, default=48)
    p.add_argument("--short", type=int, default=30, help="requests with a long answer")
    p.add_argument("--short-prompt", type=int, default=16)
    p.add_argument("--short-answer", type=int, default=96)
    p.add_argument("--every", type=int, default=2, help="steps between two arrivals")
    p.add_argument("--kv-blocks", type=int_list, default=[120, 140, 160, 180, 200],
                   help=f"the device pools, comma-separated (blocks of {BLOCK})")
    p.add_argument("--host-blocks", type=int, default=16, help=f"the host tier (blocks of {BLOCK})")
    p.add_argument("--preemption", type=mode_list, default=["auto"],
                   help="the preemption modes, comma-separated (auto, swap, recompute)")
    p.add_argument("--weights", default="", help="the cost policy's CostWeights, e.g. repeat=0.2,wait=0")
    p.add_argument("--hidden-size", type=int, default=BENCH_LLAMA["hidden_size"],
                   help="text model width (the figures in the docs use the default)")
    p.add_argument("--num-layers", type=int, default=BENCH_LLAMA["num_hidden_layers"])
    p.add_argument("--repeats", type=int, default=3, help="counted rounds of each policy in each cell")
    p.add_argument("--seed", type=int, default=0, help="the workload's draw and the model's weights")


def int_list(text: str) -> list[int]:
    """Positive integers, comma-separated."""
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers such as 120,160, got {text!r}")
    return values


def mode_list(text: str) -> list[str]:
    """Preemption modes, comma-separated."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    wrong = [m for m in modes if m not in PREEMPTION_MODES]
    if not modes or wrong:
        raise argparse.ArgumentTypeError(f"preemption modes are {', '.join(PREEMPTION_MODES)}; got {text!r}")
    return modes


def workload(args: argparse.Namespace) -> list[tuple[list[int], SamplingParams]]:
    """The requests in arrival order (``--workload``), drawn from ``--seed``."""
    rng = random.Random(args.seed)
    vocab = BENCH_LLAMA["vocab_size"]
    if args.workload == "mixed-lengths":
        sizes = ([(rng.randint(270, 330), rng.randint(4, 16)) for _ in range(10)]
                 + [(rng.randint(24, 36), rng.randint(120, 200)) for _ in range(10)])
    else:
        sizes = ([(args.long_prompt, args.long_answer)] * args.long
                 + [(args.short_prompt, args.short_answer)] * args.short)
    requests = [([rng.randrange(vocab) for _ in range(prompt)], answer) for prompt, answer in sizes]
    rng.shuffle(requests)
    return [(prompt, SamplingParams(max_tokens=answer, ignore_eos=True)) for prompt, answer in requests]


def serve(engine: Engine, requests: list, every: int) -> tuple[list[list[int]], float, list[float]]:
    """Each request added ``every`` steps after the one before, stepping until all finish: the
    outputs in arrival order, the seconds from the first arrival to the last output, and each
    request's latency (its arrival to its last token)."""
    arrived: dict[int, float] = {}
    finished: dict[int, tuple[list[int], float]] = {}
    order: list[int] = []
    pending, step = list(requests), 0
    with gc_paused():
        start = time.perf_counter()
        while pending or engine.has_unfinished():
            if pending and step % every == 0:
                prompt, params = pending.pop(0)
                request_id = engine.add_request(prompt, params)
                arrived[request_id] = time.perf_counter()
                order.append(request_id)
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = (out.token_ids, time.perf_counter())
            step += 1
        seconds = time.perf_counter() - start
    return ([finished[r][0] for r in order], seconds,
            [finished[r][1] - arrived[r] for r in order])


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(args: argparse.Namespace) -> dict:
    weights = CostWeights(**{k: float(v) for k, v in
                             (item.split("=") for item in args.weights.split(",") if item)})
    requests = workload(args)
    heads, kv_heads = BENCH_LLAMA["num_attention_heads"], BENCH_LLAMA["num_key_value_heads"]
    block_bytes = args.num_layers * 2 * BLOCK * kv_heads * (args.hidden_size // heads) * 4  # fp32
    cells, outputs, speeds = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        model = save_random_llama(Path(tmp) / "llama", args.seed, **text_size(args.hidden_size, args.num_layers))

        def serve_with(blocks: int, mode: str, policy: str) -> tuple[list[list[int]], dict]:
            engine = Engine(model, kv_cache_memory=blocks * block_bytes,
                            host_kv_memory=args.host_blocks * block_bytes, block_size=BLOCK,
                            device="cpu", dtype="float32", preemption=mode, preemption_policy=policy,
                            preemption_weights=weights)
            outs, seconds, latencies = serve(engine, requests, args.every)
            speeds[:] = [engine.scheduler.speeds]
            return outs, figures(engine.stats(), seconds, latencies)

        serve_with(args.kv_blocks[0], args.preemption[0], POLICIES[0])  # settles the process, uncounted
        for blocks in args.kv_blocks:
            for mode in args.preemption:
                runs: dict[str, list[dict]] = {policy: [] for policy in POLICIES}
                for round_ in range(len(cells), len(cells) + args.repeats):  # each cell's first
                    for policy in POLICIES if round_ % 2 == 0 else POLICIES[::-1]:  # round alternates too
                        outs, figs = serve_with(blocks, mode, policy)
                        outputs.append(outs)
                        runs[policy].append(figs)
                cells.append(cell(blocks, mode, runs))
                print(json.dumps(cells[-1]), file=sys.stderr, flush=True)  # a long grid's progress
    ratios = [c["seconds_cost_vs_newest"] for c in cells]
    return {"workload": args.workload, "requests": len(requests), "seed": args.seed,
            "host_blocks": args.host_blocks, "weights": args.weights or "default",
            "restore_speeds": {"flops": round(speeds[0].flops), "swap_latency_s": speeds[0].swap_latency,
                               "swap_block_s": speeds[0].swap_block_seconds},
            "seconds_cost_vs_newest_min": min(ratios), "seconds_cost_vs_newest_max": max(ratios),
            "cells": cells, "outputs_equal": all(o == outputs[0] for o in outputs)}


def figures(stats: dict, seconds: float, latencies: list[float]) -> dict:
    """One run's figures (the module docstring)."""
    return {"seconds": seconds, "recomputed_tokens": stats["recomputed_tokens"],
            "swapped_bytes": stats["swapped_bytes"], "preemptions_swap": stats["preemptions_swap"],
            "preemptions_recompute": stats["preemptions_recompute"],
            "latency_p50_s": quantile(latencies, 0.5), "latency_p99_s": quantile(latencies, 0.99),
            "max_preemptions_per_request": stats["max_preemptions_per_request"]}


def cell(blocks: int, mode: str, runs: dict[str, list[dict]]) -> dict:
    """A pool and mode's medians by policy and the ratios of ``cost`` to ``newest``."""
    result: dict = {"kv_blocks": blocks, "preemption": mode}
    for policy in POLICIES:
        for name in runs[policy][0]:
            value = statistics.median(r[name] for r in runs[policy])
            result[f"{name}_{policy}"] = round(value, 3) if isinstance(value, float) else value
    for name in ("recomputed_tokens", "swapped_bytes"):
        result[f"{name}_cost_vs_newest"] = round(result[f"{name}_cost"] / max(1, result[f"{name}_newest"]), 3)
    result["seconds_cost_vs_newest"] = round(statistics.median(
        c["seconds"] / n["seconds"] for c, n in zip(runs["cost"], runs["newest"])), 3)
    return result
