"""Entry point: ``python -m mmkv.bench cache --json``. Exits non-zero when a benchmark's outputs fail
its check: they differ from its peer's (``outputs_equal`` or ``outputs_near_greedy`` false), or a
constrained output breaks its constraint (``all_outputs_valid`` false). A speed figure over wrong
outputs means nothing."""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import sys

# name: module under mmkv.bench. Imported when the command runs, not when this module is: a
# benchmark's spawned processes import the command's main module again, and must not load torch
# for it (bench weights' llama.cpp processes measure their own memory).
BENCHMARKS = {"cache": "cache_bench", "prefix": "prefix_bench", "image-qa": "image_qa_bench",
              "spec": "spec_bench", "spec-compare": "spec_compare", "cross": "cross_bench",
              "serve": "serve_bench", "gpu": "gpu_bench", "distributed": "distributed_bench",
              "preemption": "preemption_bench", "kv-dtype": "kv_dtype_bench",
              "structured": "structured_bench", "weights": "weights_bench", "penalties": "penalties_bench"}
CHECKS = {"outputs_equal": "outputs differ between mmkv and its peer",  # a benchmark failing one exits 1
          "outputs_near_greedy": "outputs differ between mmkv and its peer",
          "all_outputs_valid": "an output breaks its constraint"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mmkv.bench")
    sub = parser.add_subparsers(dest="name", required=True)
    modules = {name: importlib.import_module(f"mmkv.bench.{module}") for name, module in BENCHMARKS.items()}
    for name, module in modules.items():
        p = sub.add_parser(name, help=module.__doc__.splitlines()[0])
        module.add_arguments(p)
        p.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    args = parser.parse_args(argv)
    # What exists now (the imports above built most of it: transformers' objects above all) is
    # frozen out of the collector while the benchmark runs, so the full collection before every
    # timed run (``gc_paused``) scans only what the runs build (docs/benchmarks.md: the collector);
    # it is unfrozen after, for a caller that goes on in this process.
    gc.freeze()
    try:
        result = modules[args.name].run(args)
    finally:
        gc.unfreeze()
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>32}: {value}")
    sys.stdout.flush()
    failed = [check for check in CHECKS if result.get(check) is False]
    if failed:
        reasons = "; ".join(f"{CHECKS[check]} ({check} is false)" for check in failed)
        sys.exit(f"{args.name}: {reasons}")


if __name__ == "__main__":
    main()
