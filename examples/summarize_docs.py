"""Document work with shared prefixes on the bundled model: several city reports, several
instructions each, in one call.

Every report is prefilled once; each instruction after it reuses the report's KV blocks. Prints the
answers beside the truth, what prefix caching saved, and the batch's time with caching on and off
(``stable_timing``: the median of ``--rounds`` alternating runs of a second or more each).

Run: ``python examples/summarize_docs.py [--docs 4]``.
"""

from __future__ import annotations

import argparse
import random

from stable_timing import alternate

from mmkv import Engine, SamplingParams
from mmkv.synthetic import document_prompt, random_report, report_questions

PARAMS = SamplingParams(max_tokens=64)


def engine(caching: bool) -> Engine:
    return Engine(kv_cache_memory="256MiB", host_kv_memory="32MiB", enable_prefix_caching=caching)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=4)
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3, help="alternating timed runs of each side")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    reports = [random_report(rng) for _ in range(args.docs)]
    items = [(r, qa) for r in reports for qa in report_questions(r)]
    prompts = [document_prompt(r, qa.question) for r, qa in items]

    cached, plain = engine(True), engine(False)
    outs = cached.generate(prompts, PARAMS)
    stats = cached.stats()
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
    plain_outs = plain.generate(prompts, PARAMS)
    print(f"prefilled without caching: {plain.stats()['computed_prefill_tokens']}; answers identical "
          f"with and without caching: {[o.text for o in outs] == [o.text for o in plain_outs]}")
    work = lambda e: e.generate(prompts, PARAMS, use_tqdm=False)  # noqa: E731
    seconds, repeats = alternate({"cached": (cached, work), "plain": (plain, work)}, args.rounds)
    print(f"time per batch with prefix caching {seconds['cached']:.3f}s, without {seconds['plain']:.3f}s "
          f"({seconds['plain'] / seconds['cached']:.2f}x; median of {args.rounds} alternating runs, each "
          f"the batch {repeats} times from cold caches)")


if __name__ == "__main__":
    main()
