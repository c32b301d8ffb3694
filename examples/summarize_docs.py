"""Document work with shared prefixes on the bundled model: several city reports, several
instructions each, in one call.

Every report is prefilled once; each instruction after it reuses the report's KV blocks. Prints the
answers beside the truth and what prefix caching saved, and runs the same batch with caching off.

Run: ``python examples/summarize_docs.py [--docs 4]``.
"""

from __future__ import annotations

import argparse
import random
import time

from mmkv import Engine, SamplingParams
from mmkv.synthetic import document_prompt, random_report, report_questions

PARAMS = SamplingParams(max_tokens=64)


def run(prompts, caching: bool):
    engine = Engine(kv_cache_memory="256MiB", host_kv_memory="32MiB", enable_prefix_caching=caching)
    start = time.perf_counter()
    outs = engine.generate(prompts, PARAMS)
    return outs, time.perf_counter() - start, engine.stats()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=4)
    parser.add_argument("--seed", type=int, default=5)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    reports = [random_report(rng) for _ in range(args.docs)]
    items = [(r, qa) for r in reports for qa in report_questions(r)]
    prompts = [document_prompt(r, qa.question) for r, qa in items]

    outs, seconds, stats = run(prompts, caching=True)
    right = 0
    for (report, qa), out in zip(items, outs):
        if qa.kind == "population":
            print(f"\n{report.text[:110]}...")
        got = out.text.strip()
        right += got == qa.answer
        print(f"  {qa.question:<40} {got}" + ("" if got == qa.answer else f"   [WRONG, truth: {qa.answer}]"))
    print(f"\n{right}/{len(items)} answers exactly right")
    total, computed = stats["prompt_tokens"], stats["computed_prefill_tokens"]
    print(f"prompt tokens {total}, prefilled {computed}, served from cache {total - computed} "
          f"({(total - computed) / total:.0%}); requests that hit the cache: "
          f"{sum(o.cached_tokens > 0 for o in outs)}/{len(outs)}")
    plain, plain_seconds, plain_stats = run(prompts, caching=False)
    print(f"time with prefix caching {seconds:.2f}s, without {plain_seconds:.2f}s "
          f"({plain_seconds / seconds:.1f}x); prefilled without caching: "
          f"{plain_stats['computed_prefill_tokens']}")
    print(f"answers identical with and without caching: "
          f"{[o.text for o in outs] == [o.text for o in plain]}")


if __name__ == "__main__":
    main()
