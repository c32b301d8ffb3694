"""Preemption policies under memory pressure: ``cost`` against ``newest`` on one workload.

A random Llama (hidden 512, 8 layers, fp32) serves a mix of ``--long`` requests with long prompts
and short answers and ``--short`` requests with short prompts and long answers, arriving one
every ``--every`` engine steps in a seeded order, on a device pool of ``--kv-blocks`` blocks (far
too small for the batch) and a host tier of ``--host-blocks``. Each policy
serves the same arrivals on a fresh engine; the policies alternate for ``--repeats`` rounds after
one uncounted round, and each figure is the median of its policy's rounds. Greedy outputs must be
equal across the policies (preemption never changes an output).

Per policy: seconds (first arrival to last output), ``recomputed_tokens`` (tokens computed again
at positions a sequence had computed before it was preempted), ``swapped_bytes``, preemptions by
kind, request latency p50/p99 (arrival to last token) and the most preemptions of one request;
``recomputed_tokens_cost_vs_newest``, the ratio of the medians, and ``seconds_cost_vs_newest``,
the median over rounds of each round's ratio (the two runs of a round are seconds apart, so the
machine's drift between rounds cancels).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from mmkv import Engine, SamplingParams
from mmkv.bench import gc_paused
from mmkv.bench.random_models import BENCH_LLAMA, save_random_llama, text_size
from mmkv.preemption import POLICIES, CostWeights

BLOCK = 16


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--long", type=int, default=10, help="requests with a long prompt")
    p.add_argument("--long-prompt", type=int, default=1024)
    p.add_argument("--long-answer", type=int, default=48)
    p.add_argument("--short", type=int, default=30, help="requests with a long answer")
    p.add_argument("--short-prompt", type=int, default=16)
    p.add_argument("--short-answer", type=int, default=96)
    p.add_argument("--every", type=int, default=2, help="steps between two arrivals")
    p.add_argument("--kv-blocks", type=int, default=140, help=f"the device pool (blocks of {BLOCK})")
    p.add_argument("--host-blocks", type=int, default=16, help=f"the host tier (blocks of {BLOCK})")
    p.add_argument("--weights", default="", help="the cost policy's CostWeights, e.g. repeat=0.2,wait=0")
    p.add_argument("--hidden-size", type=int, default=BENCH_LLAMA["hidden_size"],
                   help="text model width (the figures in the docs use the default)")
    p.add_argument("--num-layers", type=int, default=BENCH_LLAMA["num_hidden_layers"])
    p.add_argument("--repeats", type=int, default=5, help="counted rounds of each policy")
    p.add_argument("--seed", type=int, default=0)


def workload(args: argparse.Namespace) -> list[tuple[list[int], SamplingParams]]:
    """The requests in arrival order: long prompts with short answers, short with long."""
    rng = random.Random(args.seed)
    vocab = BENCH_LLAMA["vocab_size"]
    requests = ([([rng.randrange(vocab) for _ in range(args.long_prompt)], args.long_answer)
                 for _ in range(args.long)]
                + [([rng.randrange(vocab) for _ in range(args.short_prompt)], args.short_answer)
                   for _ in range(args.short)])
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
    runs: dict[str, list[dict]] = {policy: [] for policy in POLICIES}
    outputs: dict[str, list[list[int]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = save_random_llama(Path(tmp) / "llama", args.seed, **text_size(args.hidden_size, args.num_layers))
        for round_ in range(args.repeats + 1):  # the first round settles the process, uncounted
            for policy in POLICIES if round_ % 2 == 0 else POLICIES[::-1]:
                engine = Engine(model, kv_cache_memory=args.kv_blocks * block_bytes,
                                host_kv_memory=args.host_blocks * block_bytes, block_size=BLOCK,
                                device="cpu", dtype="float32", preemption_policy=policy,
                                preemption_weights=weights)
                outs, seconds, latencies = serve(engine, requests, args.every)
                outputs.setdefault(policy, outs)
                if outputs[policy] != outs:
                    outputs[policy] = []  # a policy whose runs disagree fails outputs_equal
                if round_:
                    stats = engine.stats()
                    runs[policy].append({
                        "seconds": seconds, "recomputed_tokens": stats["recomputed_tokens"],
                        "swapped_bytes": stats["swapped_bytes"],
                        "preemptions_swap": stats["preemptions_swap"],
                        "preemptions_recompute": stats["preemptions_recompute"],
                        "latency_p50_s": quantile(latencies, 0.5),
                        "latency_p99_s": quantile(latencies, 0.99),
                        "max_preemptions_per_request": stats["max_preemptions_per_request"]})
    result: dict = {"requests": len(requests), "kv_blocks": args.kv_blocks,
                    "host_blocks": args.host_blocks, "weights": args.weights or "default"}
    for policy in POLICIES:
        for name in runs[policy][0]:
            value = statistics.median(r[name] for r in runs[policy])
            result[f"{name}_{policy}"] = round(value, 3) if isinstance(value, float) else value
    result["recomputed_tokens_cost_vs_newest"] = round(
        result["recomputed_tokens_cost"] / max(1, result["recomputed_tokens_newest"]), 3)
    result["seconds_cost_vs_newest"] = round(statistics.median(
        c["seconds"] / n["seconds"] for c, n in zip(runs["cost"], runs["newest"])), 3)
    result["outputs_equal"] = bool(outputs["cost"]) and outputs["cost"] == outputs["newest"]
    return result
