"""Speculative decoding on the bundled model: the same answers, fewer target passes.

Describes a few scenes and summarises a few reports with plain greedy decoding, with the model's
own early exit as the draft, and with the bundled separate draft model (with the settings measured
fastest on the bundled model, ``BUNDLED_SPECULATION``: up to 24 draft tokens a round, drafting
stopped once the draft's confidence falls below 0.9), one request at a time; prints tokens per
second, acceptance and whether every output is identical.

Run: ``python examples/spec_speedup.py [--requests 6]``.
"""

from __future__ import annotations

import argparse
import random

from mmkv import Engine, SamplingParams
from mmkv.bench import timed
from mmkv.bundled import BUNDLED_DRAFT_MODEL, BUNDLED_MODEL, BUNDLED_SPECULATION
from mmkv.synthetic import document_prompt, random_report, random_scene, scene_prompt
from speculative import SpeculativeConfig

PARAMS = SamplingParams(max_tokens=48)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--seed", type=int, default=21)
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
    reference, plain_rate = None, None
    for name, config in variants.items():
        engine = Engine(kv_cache_memory="128MiB", host_kv_memory="16MiB", speculative=config)
        engine.generate(prompts[:1], SamplingParams(max_tokens=4))  # warm-up
        outs, seconds = timed(lambda: [engine.generate([p], PARAMS)[0] for p in prompts])
        rate = sum(len(o.token_ids) for o in outs) / seconds
        reference = reference or [o.token_ids for o in outs]
        plain_rate = plain_rate or rate
        stats = engine.stats()
        extra = (f", acceptance {stats['spec_acceptance_rate']:.0%}, "
                 f"{stats['spec_mean_tokens_per_round']:.2f} tokens per target pass") if config else ""
        print(f"{name:>12}: {rate:7.1f} tokens/s ({rate / plain_rate:.2f}x){extra}; "
              f"outputs identical to plain: {[o.token_ids for o in outs] == reference}")
    print(f"\nexample answer: {outs[0].text.strip()!r}")


if __name__ == "__main__":
    main()
