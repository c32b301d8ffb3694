"""Penalties' cost: tokens/s with and without every penalty on the bundled model.

The bundled model answers ``--requests`` report questions at batch 32 (all at once) and
``--batch1-requests`` of them one at a time, greedy, ``--max-tokens`` tokens each (``ignore_eos``,
so both runs make the same number of tokens), free and with ``repetition_penalty=1.1``,
``frequency_penalty=0.5``, ``presence_penalty=0.5`` and ``min_tokens`` of half the tokens. Per
batch size: generated tokens per second of each (the fastest of ``--repeats`` runs on fresh
engines, taking turns) and their ratio (``penalised_vs_free_tokens_per_s_b1`` / ``_b32``);
``penalised_outputs_differ``: some penalised answer differs from its free one (the penalties ran).
"""

from __future__ import annotations

import argparse
import random

from mmkv import SamplingParams
from mmkv.bench import add_bundled_answer_arguments, serve_bundled
from mmkv.synthetic import document_prompt, random_report


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_bundled_answer_arguments(p)


def run(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    prompts = [document_prompt(random_report(rng), "summarise the report.") for _ in range(args.requests)]
    free = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    penalised = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, repetition_penalty=1.1,
                               frequency_penalty=0.5, presence_penalty=0.5, min_tokens=args.max_tokens // 2)
    result: dict = {}
    texts: dict[str, list[list[int]]] = {}
    for label, served, batch in (("b1", prompts[:args.batch1_requests], 1), ("b32", prompts, len(prompts))):
        best = {"free": 0.0, "penalised": 0.0}
        for _ in range(args.repeats):
            for name, params in (("free", free), ("penalised", penalised)):
                outs, seconds = serve_bundled(served, batch, [params] * len(served))
                texts[name] = [o.token_ids for o in outs]
                best[name] = max(best[name], sum(map(len, texts[name])) / seconds)
        result[f"free_tokens_per_s_{label}"] = round(best["free"], 1)
        result[f"penalised_tokens_per_s_{label}"] = round(best["penalised"], 1)
        result[f"penalised_vs_free_tokens_per_s_{label}"] = round(best["penalised"] / best["free"], 3)
    result["penalised_outputs_differ"] = texts["free"] != texts["penalised"]
    return result
