"""Speculative decoding on the bundled model: the same answers, fewer target passes.

Describes a few scenes and summarises a few reports with plain greedy decoding, with the model's
own early exit as the draft, and with the bundled separate draft model (with the settings measured
fastest on the bundled model, ``BUNDLED_SPECULATION``: up to 24 draft tokens a round, drafting
stopped once the draft's confidence falls below 0.9), one request at a time; prints whether every
output is identical, the acceptance, then tokens per second (``stable_timing``: the median of
``--rounds`` alternating runs of a second or more each).

Run: ``python examples/spec_speedup.py [--requests 6]``.
"""

from __future__ import annotations

import argparse
import random

from stable_timing import alternate

from mmkv import Engine, SamplingParams
from mmkv.bundled import BUNDLED_DRAFT_MODEL, BUNDLED_MODEL, BUNDLED_SPECULATION
from mmkv.synthetic import document_prompt, random_report, random_scene, scene_prompt
from speculative import SpeculativeConfig

PARAMS = SamplingParams(max_tokens=48)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--seed", type=int, default=21)
    parser.add_argument("--rounds", type=int, default=3, help="alternating timed runs of each variant")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    prompts = [{"prompt": scene_prompt("describe the scene."), "images": [random_scene(rng).render()]}
               for _ in range(args.requests)]
    prompts += [document_prompt(random_report(rng), "summarise the report.") for _ in range(args.requests)]
    variants = {
        "plain": None,
        "early exit": SpeculativeConfig(method="early_exit", **BUNDLED_SPECULATION),
        "draft model": SpeculativeConfig(method="draft_model", **BUNDLED_SPECULATION,
                                         draft_model=BUNDLED_DRAFT_MODEL),
    }
    engines = {name: Engine(kv_cache_memory="128MiB", host_kv_memory="16MiB", speculative=config)
               for name, config in variants.items()}
    work = lambda e: [e.generate([p], PARAMS)[0] for p in prompts]  # noqa: E731
    outputs = {name: work(engine) for name, engine in engines.items()}
    tokens = sum(len(o.token_ids) for o in outputs["plain"])
    for name, engine in engines.items():
        stats = engine.stats()
        extra = (f"; acceptance {stats['spec_acceptance_rate']:.0%}, "
                 f"{stats['spec_mean_tokens_per_round']:.2f} tokens per target pass") if variants[name] else ""
        same = [o.token_ids for o in outputs[name]] == [o.token_ids for o in outputs["plain"]]
        print(f"{name:>12}: outputs identical to plain: {same}{extra}")
    seconds, repeats = alternate({name: (engine, work) for name, engine in engines.items()}, args.rounds)
    for name in engines:
        rate = tokens / seconds[name]
        print(f"{name:>12}: {rate:7.1f} tokens/s ({seconds['plain'] / seconds[name]:.2f}x)")
    print(f"(median of {args.rounds} alternating runs, each the {len(prompts)} requests {repeats} times)")
    print(f"\nexample answer: {outputs['plain'][0].text.strip()!r}")

if __name__ == "__main__":
    main()
