"""Exact-match accuracy of a model on held-out synthetic scenes and documents.

    python -m mmkv.eval --json        # the bundled model, 500 scene and 200 document questions

Questions come from ``mmkv.synthetic`` with seeds the training script never uses. Every answer is
produced with prefix caching (and image sharing) on, with it off, and (for a model with an early
exit) with early-exit speculative decoding, and must be identical each time.
``--dtype bfloat16`` answers in bfloat16, ``--kv-cache-dtype int8|fp8_e4m3`` over a compressed
KV cache and ``--quantization int8|int4`` with quantized weights; each also reports the reference's accuracy (float32, uncompressed: ``reference_*``) and
how many answers the two share (``answers_equal_reference``). The last line of ``--json`` output is
one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

from mmkv.bundled import BUNDLED_MODEL, BUNDLED_SPECULATION
from mmkv.engine import Engine
from mmkv.models.base import read_config_json
from mmkv.sampling_params import SamplingParams
from mmkv.synthetic import document_examples, document_prompt, scene_examples, scene_prompt
from speculative import SpeculativeConfig

EVAL_SEED = 7  # training seeds start at 1000
MAX_ANSWER_TOKENS = 64


def questions(scenes: int, documents: int, seed: int = EVAL_SEED) -> list[tuple[dict | str, str, str, str]]:
    """(prompt, answer, task, question kind) for held-out scene and document questions."""
    out = []
    for scene, qa in scene_examples(seed, scenes):
        out.append(({"prompt": scene_prompt(qa.question), "images": [scene.render()]}, qa.answer,
                    "scene", qa.kind))
    for report, qa in document_examples(seed, documents):
        out.append((document_prompt(report, qa.question), qa.answer, "document", qa.kind))
    return out


def answer_all(model: Path, prompts: list, caching: bool, speculative: SpeculativeConfig | None = None,
               dtype: str = "float32", kv_cache_dtype: str = "auto",
               quantization: str | None = None) -> tuple[list[str], float, dict]:
    engine = Engine(model, kv_cache_memory="512MiB", host_kv_memory="64MiB", dtype=dtype,
                    enable_prefix_caching=caching, speculative=speculative, kv_cache_dtype=kv_cache_dtype,
                    quantization=quantization)
    start = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_ANSWER_TOKENS))
    return [o.text.strip() for o in outs], time.perf_counter() - start, engine.stats()


def accuracy(answers: list[str], items: list) -> dict[str, float]:
    """Exact-match accuracy per task (``scene``, ``document``) and per ``task/kind``."""
    right: dict[str, list[bool]] = defaultdict(list)
    for got, (_, want, task, kind) in zip(answers, items):
        right[task].append(got == want)
        right[f"{task}/{kind}"].append(got == want)
    return {k: round(sum(v) / len(v), 4) for k, v in sorted(right.items())}


def evaluate(model: Path, scenes: int, documents: int, seed: int = EVAL_SEED,
             dtype: str = "float32", kv_cache_dtype: str = "auto",
             quantization: str | None = None) -> dict:
    items = questions(scenes, documents, seed)
    prompts = [p for p, *_ in items]
    options = {"dtype": dtype, "kv_cache_dtype": kv_cache_dtype, "quantization": quantization}
    cached, cached_s, stats = answer_all(model, prompts, caching=True, **options)
    plain, plain_s, _ = answer_all(model, prompts, caching=False, **options)
    speculated = None
    if read_config_json(model).get("early_exit_layer") is not None:
        speculated, _, _ = answer_all(model, prompts, caching=True, **options,
                                      speculative=SpeculativeConfig(**BUNDLED_SPECULATION))
    acc = accuracy(cached, items)
    versus_reference = {}
    if dtype != "float32" or kv_cache_dtype != "auto" or quantization is not None:
        reference, reference_s, _ = answer_all(model, prompts, caching=True)
        ref_acc = accuracy(reference, items)
        versus_reference = {"reference_scene_accuracy": ref_acc.get("scene", 0.0),
                            "reference_document_accuracy": ref_acc.get("document", 0.0),
                            "answers_equal_reference": round(
                                sum(a == b for a, b in zip(cached, reference)) / len(items), 4),
                            "reference_seconds_with_caching": round(reference_s, 2)}
    return {
        "dtype": dtype,
        "kv_cache_dtype": kv_cache_dtype,
        "quantization": quantization,
        "scene_accuracy": acc.get("scene", 0.0),
        "document_accuracy": acc.get("document", 0.0),
        "scene_questions": scenes,
        "document_questions": documents,
        "identical_with_and_without_caching": cached == plain,
        "identical_with_speculation": None if speculated is None else speculated == cached,
        "seconds_with_caching": round(cached_s, 2),
        "seconds_without_caching": round(plain_s, 2),
        "encoder_calls": stats.get("encoder_calls", 0),
        "by_kind": {k: v for k, v in acc.items() if "/" in k},
        **versus_reference,
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m mmkv.eval", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=BUNDLED_MODEL)
    parser.add_argument("--scenes", type=int, default=500)
    parser.add_argument("--documents", type=int, default=200)
    parser.add_argument("--seed", type=int, default=EVAL_SEED)
    parser.add_argument("--dtype", default="float32", help="float32 (exact) or bfloat16 (fast)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto (the model's dtype), int8 or fp8_e4m3")
    parser.add_argument("--quantization", choices=("int8", "int4"), help="quantized weights")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = evaluate(args.model, args.scenes, args.documents, args.seed, args.dtype, args.kv_cache_dtype,
                      args.quantization)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>36}: {value}")


if __name__ == "__main__":
    main()
