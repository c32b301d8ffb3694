"""Batched image Q&A on the bundled model: many questions about each of a few scenes, one call.

Prints every answer beside the truth, then what sharing saved: encoder calls, cross-attention K/V
computed once per image and read by every question, prefill tokens served from the cache, and the
time of the same batch with all reuse switched off (``stable_timing``: the median of ``--rounds``
alternating runs of a second or more each, from cold caches). Writes a PNG grid of the scenes with
their questions and answers.

Run: ``make demo`` or ``python examples/image_qa.py [--scenes 6] [--out image_qa.png]``.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from PIL import Image, ImageDraw
from stable_timing import alternate

from mmkv import Engine, SamplingParams
from mmkv.synthetic import random_scene

PARAMS = SamplingParams(max_tokens=64)
COUNTERS = ("encoder_calls", "xattn_blocks_computed", "prompt_tokens", "computed_prefill_tokens")


def run(engine: Engine, images, questions):
    """One batched call: its answers and counters."""
    before = engine.stats()
    answers = engine.ask(images, questions, PARAMS)
    after = engine.stats()
    return answers, {name: after[name] - before[name] for name in COUNTERS}


def grid(scenes, questions, answers, truths, path: Path) -> None:
    tile, text_w, line = 192, 560, 13
    height = max(tile, line * (len(questions) + 1)) + 16
    canvas = Image.new("RGB", (tile + text_w, height * len(scenes)), "white")
    draw = ImageDraw.Draw(canvas)
    for i, (scene, row, want) in enumerate(zip(scenes, answers, truths)):
        top = i * height + 8
        canvas.paste(scene.render().resize((tile, tile), Image.NEAREST), (8, top))
        for j, (q, out, w) in enumerate(zip(questions, row, want)):
            mark = "ok" if out.text.strip() == w else "WRONG"
            draw.text((tile + 20, top + j * line), f"{q} -> {out.text.strip()}  [{mark}]", fill="black")
    canvas.save(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenes", type=int, default=6)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("image_qa.png"))
    parser.add_argument("--rounds", type=int, default=3, help="alternating timed runs of each mode")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    scenes = [random_scene(rng) for _ in range(args.scenes)]
    warm_up = random_scene(rng).render()
    # The same questions for every scene, so each scene's answers can be checked.
    questions = ["how many shapes are there?", "how many circles are there?",
                 "how many squares are there?", "is there a red circle?", "is there a blue square?",
                 "what is at the centre?", "what is at the top left?", "describe the scene."]
    truths = [[scene.answer(q) for q in questions] for scene in scenes]

    images = [s.render() for s in scenes]
    shared, alone = (Engine(kv_cache_memory="256MiB", host_kv_memory="32MiB", enable_prefix_caching=caching)
                     for caching in (True, False))
    for engine in (shared, alone):
        engine.ask(warm_up, ["warm up"], SamplingParams(max_tokens=2))
    answers, stats = run(shared, images, questions)
    _, plain = run(alone, images, questions)
    right = 0
    for i, (scene, row, want) in enumerate(zip(scenes, answers, truths)):
        print(f"scene {i}: {scene.describe()}")
        for q, out, w in zip(questions, row, want):
            got = out.text.strip()
            right += got == w
            print(f"  {q:<28} {got:<60} {'ok' if got == w else 'WRONG, truth: ' + w}")
    total = len(scenes) * len(questions)
    print(f"\n{right}/{total} answers exactly right")

    print(f"encoder calls: {stats['encoder_calls']} for {len(scenes)} images and {total} questions "
          f"(without sharing: {plain['encoder_calls']})")
    print(f"cross-attention K/V blocks computed: {stats['xattn_blocks_computed']} "
          f"(without sharing: {plain['xattn_blocks_computed']})")
    saved = stats["prompt_tokens"] - stats["computed_prefill_tokens"]
    print(f"prompt tokens {stats['prompt_tokens']}, prefilled {stats['computed_prefill_tokens']}, "
          f"served from cache {saved}")
    work = lambda e: e.ask(images, questions, PARAMS)  # noqa: E731
    seconds, repeats = alternate({"shared": (shared, work), "alone": (alone, work)}, args.rounds)
    print(f"time per batch with sharing {seconds['shared']:.2f}s, without {seconds['alone']:.2f}s "
          f"({seconds['alone'] / seconds['shared']:.2f}x; median of {args.rounds} alternating runs, "
          f"each the batch {repeats} times from cold caches)")
    grid(scenes, questions, answers, truths, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
