"""Cross-attention over image K/V: every image group in one native kernel call against each apart.

The bundled model's scene questions (one image each, as ``bench spec`` serves them) decode
plainly at each batch size on fresh engines, once with the step's image groups attended in one
call of the native decode kernel where their pages lie (``attention.metadata.OneCallLimits``
decides which steps) and once with every group apart (``CrossApartEngine``: a page
gather and SDPA per group, the torch path), the two engines taking turns step by step
(``spec_bench.in_turns``), each leading half the rounds. ``one_call_speedup_b<N>`` is the median
over pairs of rounds of each pair's mean ratio (``spec_bench.paired``); the outputs must be equal.
"""

from __future__ import annotations

import argparse

from mmkv.bench.spec_bench import BUNDLED_MODEL, fresh_engine, in_turns, paired, warm_ups, workloads
from mmkv.bench.variants import CrossApartEngine
from mmkv.engine import Engine


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=32, help="scene questions, served at batch 8 and 32")
    p.add_argument("--batch1-requests", type=int, default=8, help="scene questions served one at a time")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--repeats", type=int, default=6,
                   help="rounds of both variants, rounded up to an even number so that each leads "
                        "as many (a first is not counted)")
    p.add_argument("--seed", type=int, default=11)


def run(args: argparse.Namespace) -> dict:
    scenes = workloads(args.requests, args.seed)["scenes"]
    warm_up = warm_ups(args.seed)["scenes"]
    result, equal = {}, True
    for batch in [int(b) for b in args.batches.split(",")]:
        prompts = scenes[:args.batch1_requests] if batch == 1 else scenes
        seconds: dict[str, list[float]] = {"one_call": [], "apart": []}
        outputs = {}
        for round_ in range(args.repeats + args.repeats % 2 + 1):  # the first settles the process, uncounted
            engines = {variant: fresh_engine(BUNDLED_MODEL, warm_up, batch, None, engine_class=kind)
                       for variant, kind in (("one_call", Engine), ("apart", CrossApartEngine))}
            for variant, (outs, s, _) in in_turns(engines, prompts, batch, seed=round_).items():
                equal &= outputs.setdefault(variant, outs) == outs
                if round_:
                    seconds[variant].append(s)
        equal &= outputs["one_call"] == outputs["apart"]
        result[f"one_call_speedup_b{batch}"] = round(paired(seconds["apart"], seconds["one_call"]), 2)
    result["outputs_equal"] = equal
    return result
