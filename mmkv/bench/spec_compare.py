"""A change of the speculation controller's settings against its defaults, engines taking turns.

``python -m mmkv.bench spec-compare --method early_exit --load summaries --batch 8 --set explore=1``:
each round a plain engine, a speculative engine on the controller's default settings (``old``) and
one on the changed settings (``new``), fresh and warmed up as ``bench spec`` makes them, serve the
prompts ``bench spec`` serves in that cell, taking turns step by step (``spec_bench.in_turns``),
each engine leading a third of the rounds. It reports ``new_over_old`` (old's seconds over new's:
above 1, the change is faster) and each one's speedup over the plain engine, per round and as the
median over groups of three rounds, one led by each engine (``spec_bench.paired``), the draft tokens
each speculative engine proposed, and the thread count each engine's decoding steps ended on with
the log of the other count's time over it (``decode_threads_<engine>``, from the last round); the
first round is left out (it warms the process). ``--set`` takes any field of
``speculative.controller.Settings``; without it the two speculative engines are identical, which
shows the comparison's own noise.

Three engines taking turns run slower than two, and speculation loses less of its speed among
three than plain decoding does, so the speedups here read higher than ``bench spec``'s pairs; the
ratio between the two speculative engines, which meet the same conditions, is what to read.
"""

from __future__ import annotations

import argparse
from dataclasses import fields, replace
from pathlib import Path

from mmkv.bench.spec_bench import (BATCH1_REQUESTS, LOADS, PLAIN, REGIMES, REQUESTS, fresh_engine, in_turns,
                                   pace_of, paired, served, warm_ups, workloads)
from mmkv.bundled import BUNDLED_DRAFT_MODEL, BUNDLED_MODEL, BUNDLED_SPECULATION
from speculative import SpeculativeConfig
from speculative.controller import Settings

METHODS = ("early_exit", "draft_model")
ENGINES = (PLAIN, "old", "new")  # built and led in this order (``spec_bench.in_turns``)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, default=BUNDLED_MODEL)
    p.add_argument("--draft", type=Path, default=BUNDLED_DRAFT_MODEL)
    p.add_argument("--method", choices=METHODS, default="early_exit")
    p.add_argument("--load", choices=LOADS, default="summaries")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--regime", choices=REGIMES, default="greedy",
                   help="greedy, sampled at a temperature (t0.7, t1.0), or arrivals into a running batch")
    p.add_argument("--requests", type=int, default=None,
                   help="requests served (default: 8 at batch 1, 32 otherwise, as bench spec)")
    p.add_argument("--rounds", type=int, default=9,
                   help="counted rounds, rounded up to a multiple of 3 so that each engine leads as "
                        "many (one more warms up)")
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--set", dest="settings", action="append", default=[], metavar="NAME=VALUE",
                   help="a controller setting of the new engine (speculative.controller.Settings)")


def run(args: argparse.Namespace) -> dict:
    if args.rounds < 1 or args.batch < 1:
        raise SystemExit(f"--rounds and --batch must be at least 1, got {args.rounds} and {args.batch}")
    try:
        settings = parse_settings(args.settings)
    except ValueError as err:
        raise SystemExit(f"--set {err}") from None
    requests = args.requests or (BATCH1_REQUESTS if args.batch == 1 else REQUESTS)
    # bench spec's prompts: it draws REQUESTS of each workload and serves the first ones at batch 1
    # (a smaller draw holds other prompts: the workloads take turns drawing from one generator)
    prompts = workloads(max(requests, REQUESTS), args.seed)[args.load][:requests]
    warm_up = warm_ups(args.seed)[args.load]
    speculative = SpeculativeConfig(method=args.method, num_tokens=BUNDLED_SPECULATION["num_tokens"],
                                    adaptive_threshold=BUNDLED_SPECULATION["adaptive_threshold"],
                                    draft_model=args.draft if args.method == "draft_model" else None)
    changed = replace(speculative, settings=settings)
    seconds: dict[str, list[float]] = {PLAIN: [], "old": [], "new": []}  # each counted round's run
    calibrated: dict[str, list[float]] = {PLAIN: [], "old": [], "new": []}  # ... and its calibration
    drafted = {"old": 0, "new": 0}
    equal = True
    params, arrivals = served(args.regime)
    rounds = -(-args.rounds // len(ENGINES)) * len(ENGINES)
    pace = None
    for round_, counted in enumerate([False] + [True] * rounds):
        engines = {name: fresh_engine(args.model, warm_up, args.batch, config)
                   for name, config in zip(ENGINES, (None, speculative, changed))}
        runs = in_turns(engines, prompts, args.batch, seed=round_, params=params, arrivals=arrivals, pace=pace)
        if arrivals and pace is None:  # the first round's plain steps pace the later ones' arrivals
            pace = pace_of(runs[PLAIN])
        equal &= runs["old"][0] == runs[PLAIN][0] == runs["new"][0]
        if counted:
            for name, run in runs.items():
                seconds[name].append(run[1])
                calibrated[name].append(run[1] + engines[name].calibration_seconds)
            for name in drafted:
                drafted[name] += runs[name][2]["spec_drafted_tokens"]
    result: dict = {"method": args.method, "load": args.load, "batch": args.batch, "regime": args.regime,
                    "settings": _changed(settings), "rounds": rounds}
    for key, base, variant in (("new_over_old", "old", "new"), ("speedup_old", PLAIN, "old"),
                               ("speedup_new", PLAIN, "new")):
        result[key] = round(paired(seconds[base], seconds[variant], len(ENGINES)), 3)
        result[f"{key}_rounds"] = [round(b / s, 3) for b, s in zip(seconds[base], seconds[variant])]
        result[f"{key}_with_calibration"] = round(paired(calibrated[base], calibrated[variant], len(ENGINES)), 3)
    result.update({f"drafted_{name}": count for name, count in drafted.items()})
    result.update({f"decode_threads_{name}": [run[2].get("decode_threads"), run[2].get("decode_threads_log_ratio")]
                   for name, run in runs.items()})
    if not args.regime.startswith("t"):  # sampled outputs are compared by distribution (bench spec)
        result["outputs_equal"] = equal
    return result


def parse_settings(assignments: list[str]) -> Settings:
    """``Settings`` from ``NAME=VALUE`` strings (the others the defaults); a name that is not a
    setting, or a value of the wrong type, raises ``ValueError`` naming it."""
    kinds = {"int": (int, "an integer"), "float": (float, "a number")}
    types = {f.name: kinds[f.type] for f in fields(Settings)}
    values = {}
    for assignment in assignments:
        name, sep, value = assignment.partition("=")
        if not sep or name not in types:
            raise ValueError(f"{assignment!r}: expected NAME=VALUE with NAME one of {sorted(types)}")
        convert, kind = types[name]
        try:
            values[name] = convert(value)
        except ValueError:
            raise ValueError(f"{assignment!r}: {name} takes {kind}") from None
    return Settings(**values)


def _changed(settings: Settings) -> dict:
    """The settings that differ from the defaults."""
    default = Settings()
    return {f.name: getattr(settings, f.name) for f in fields(Settings)
            if getattr(settings, f.name) != getattr(default, f.name)}
