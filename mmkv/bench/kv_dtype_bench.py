"""Compressed KV caches side by side: what a pool of fixed bytes holds and serves, and what
decode attention costs over long contexts, per KV format.

1. **Capacity under pressure.** The bundled model serves ``--documents`` documents of
   ``--document-tokens`` tokens (ordinary tokens of its vocabulary), each asked a question of a few
   tokens in each of ``--rounds`` rounds (every document revisited), from a pool of
   ``--kv-cache-memory`` bytes, in batches of ``--batch`` requests, greedy, ``--answer`` tokens
   each; each round visits the documents in a shuffled order (seeded), as a server's clients come
   back in no fixed order (in one fixed order, a pool too small for all of them would lose every
   one to LRU before its turn came again). Variants: float32 and bfloat16 models with their own KV
   (``fp32``, ``bf16``) and with int8 and fp8 KV (``fp32_int8``, ``fp32_fp8``, ``bf16_int8``,
   ``bf16_fp8``). Per variant: the pool's tokens and bytes per token (scales included), prompt
   tokens served from the cache (``cached_prompt_tokens``) and their share (``hit_rate``), prompt
   tokens computed again after the first round (``recomputed_prompt_tokens``), evictions, seconds
   (the fastest of ``--repeats``), and the share of answers equal to the same model's over its
   uncompressed cache (``greedy_agreement``). ``cached_prompt_tokens_int8_vs_bf16`` and
   ``seconds_int8_vs_bf16`` compare ``bf16_int8`` with ``bf16``: the same model arithmetic, only
   the cache's format differs.
2. **Long-context decode attention.** ``--long-sequences`` sequences of ``--long-context`` tokens,
   the layer shape of the benchmarks' random Llama (8 query heads, 4 KV heads of 64), one decode
   query each: seconds of the native decode kernel per layer call, the fastest of
   ``--long-steps`` calls, per cache format (``decode_attention_seconds_<format>``; the formats
   take turns, 8 calls at a time, so none is timed only in a quieter moment), and
   ``decode_attention_int8_vs_bf16``. A call reads every cached byte once; where that reading
   bounds the kernel, its time goes with the bytes a format stores (``kv_bytes_read_<format>``).
3. **Against llama.cpp** (``--peers llama.cpp``, installed by ``make bench-peers``): the capacity
   workload on the benchmarks' random Llama, ``--peer-documents`` documents, mmkv with int8 KV in
   the bytes of llama.cpp's q8_0 slots against llama.cpp serving ``--batch`` parallel slots the way
   llama-server does with its prompt cache (``LlamaCpp.serve_slots``), with q8_0 K and V (those
   bytes) and with its default f16 K and V (the same slots, more bytes). The three take turns,
   ``--repeats`` rounds, each round in an order rotated by one (each leads a round in three);
   ``speedup_int8_vs_llama_cpp_<kv>_kv`` is the median over rounds of each round's ratio of
   seconds, ``llama_cpp_q8_0_vs_f16_seconds`` likewise. Per side: seconds (the fastest round),
   prompt tokens served from its cache, and the share of answers mmkv agrees on (both quantise,
   differently, so near ties split). Both serve about the same prompt tokens from cache, so the
   speedup is speed at equal KV bytes, not what compression buys (the capacity workload above
   measures that).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cache import kv_format
from mmkv import Engine, SamplingParams
from mmkv.attention import native
from mmkv.bench import gc_paused, llama_cpp_peer, rotated
from mmkv.bench.random_models import BENCH_LLAMA, save_random_llama
from mmkv.bundled import BUNDLED_MODEL

VARIANTS = {"fp32": ("float32", "auto"), "fp32_int8": ("float32", "int8"), "fp32_fp8": ("float32", "fp8_e4m3"),
            "bf16": ("bfloat16", "auto"), "bf16_int8": ("bfloat16", "int8"), "bf16_fp8": ("bfloat16", "fp8_e4m3")}
LONG_FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8,
                "fp8": torch.float8_e4m3fn}
LONG_HEADS = (8, 4, 64)  # query heads, KV heads, head size: the benchmarks' random Llama
LONG_ROUND = 8  # calls a format makes before the next format's turn


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=str(BUNDLED_MODEL))
    p.add_argument("--kv-cache-memory", default="64MiB", help="the pool every variant gets")
    p.add_argument("--documents", type=int, default=32)
    p.add_argument("--document-tokens", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=3, help="times every document is asked about")
    p.add_argument("--batch", type=int, default=8, help="requests submitted together")
    p.add_argument("--answer", type=int, default=8, help="tokens per answer")
    p.add_argument("--repeats", type=int, default=3, help="runs per variant (seconds: the fastest)")
    p.add_argument("--long-sequences", type=int, default=4)
    p.add_argument("--long-context", type=int, default=8000)
    p.add_argument("--long-steps", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peers", default="", help="llama.cpp: also the capacity workload against its q8_0 KV")
    p.add_argument("--peer-documents", type=int, default=16, help="documents of the llama.cpp comparison")


def ordinary_tokens(engine: Engine) -> list[int]:
    """The model's token ids but its end-of-sequence and image tokens."""
    special = engine.eos_token_ids | {engine.model.image_token_id}
    return [t for t in range(engine.model.text_config.vocab_size) if t not in special]


def workload(ordinary: list[int], documents: int, args: argparse.Namespace) -> list[list[list[int]]]:
    """Each round's prompts: every document with a fresh question, in an order of its own."""
    rng = random.Random(args.seed)
    texts = [[rng.choice(ordinary) for _ in range(args.document_tokens)] for _ in range(documents)]
    rounds = []
    for _ in range(args.rounds):
        order = rng.sample(range(documents), documents)
        rounds.append([texts[i] + [rng.choice(ordinary) for _ in range(4)] for i in order])
    return rounds


def in_batches(rounds: list[list[list[int]]], batch: int) -> list[list[list[int]]]:
    return [prompts[i:i + batch] for prompts in rounds for i in range(0, len(prompts), batch)]


def serve(engine: Engine, rounds: list[list[list[int]]], args: argparse.Namespace) -> tuple[list, float]:
    """Every round's prompts in batches of ``args.batch``: the answers and the seconds."""
    params = SamplingParams(max_tokens=args.answer, ignore_eos=True)
    answers = []
    with gc_paused():
        start = time.perf_counter()
        for prompts in in_batches(rounds, args.batch):
            answers += [o.token_ids for o in engine.generate(prompts, params)]
        return answers, time.perf_counter() - start


def capacity(args: argparse.Namespace) -> dict:
    result: dict = {}
    answers: dict[str, list] = {}
    for name, (dtype, kv_cache_dtype) in VARIANTS.items():
        best = math.inf
        for _ in range(args.repeats):
            engine = Engine(args.model, kv_cache_memory=args.kv_cache_memory, host_kv_memory="16MiB",
                            device="cpu", dtype=dtype, kv_cache_dtype=kv_cache_dtype)
            rounds = workload(ordinary_tokens(engine), args.documents, args)
            outs, seconds = serve(engine, rounds, args)
            best = min(best, seconds)
        answers[name] = outs
        stats = engine.stats()
        prompt_tokens = sum(len(p) for prompts in rounds for p in prompts)
        result.update({f"pool_tokens_{name}": stats["kv_pool_tokens"],
                       f"bytes_per_token_{name}": stats["kv_bytes_per_token"],
                       f"cached_prompt_tokens_{name}": stats["cached_prompt_tokens"],
                       f"hit_rate_{name}": round(stats["cached_prompt_tokens"] / prompt_tokens, 4),
                       f"recomputed_prompt_tokens_{name}":  # computed again after the first round
                           prompt_tokens - sum(len(p) for p in rounds[0]) - stats["cached_prompt_tokens"],
                       f"evictions_{name}": stats["evictions"],
                       f"seconds_{name}": round(best, 3)})
    for name in VARIANTS:
        reference = answers["bf16" if name.startswith("bf16") else "fp32"]
        result[f"greedy_agreement_{name}"] = round(
            sum(a == b for a, b in zip(answers[name], reference)) / len(reference), 4)
    result["greedy_agreement_int8"] = result["greedy_agreement_fp32_int8"]
    result["greedy_agreement_fp8"] = result["greedy_agreement_fp32_fp8"]
    result["cached_prompt_tokens_int8_vs_bf16"] = round(
        result["cached_prompt_tokens_bf16_int8"] / max(result["cached_prompt_tokens_bf16"], 1), 3)
    result["pool_tokens_int8_vs_bf16"] = round(result["pool_tokens_bf16_int8"] / result["pool_tokens_bf16"], 3)
    result["seconds_int8_vs_bf16"] = round(result["seconds_bf16_int8"] / result["seconds_bf16"], 3)
    return result


def long_decode(args: argparse.Namespace) -> dict:
    """The native decode kernel's seconds per layer call over long contexts, per cache format."""
    if native.kernel() is None:
        return {"decode_attention_note": "the native kernel is not built here"}
    hq, hkv, dim = LONG_HEADS
    block, d = 16, args.long_sequences
    width = -(-args.long_context // block)
    g = torch.Generator().manual_seed(args.seed)
    values = torch.randn(d * width, 2, block, hkv, dim, generator=g)
    pages = torch.randperm(d * width, generator=g).view(d, width)
    lens = torch.full((d,), args.long_context)
    key_start = torch.zeros(d, dtype=torch.long)
    positions = (lens - 1).view(d, 1)
    q = torch.randn(d, 1, hq, dim, generator=g)
    layers = {name: kv_format.encode(values, dtype) for name, dtype in LONG_FORMATS.items()}
    best = dict.fromkeys(layers, math.inf)
    with gc_paused():
        for _ in range(-(-args.long_steps // LONG_ROUND)):  # the formats take turns
            for name, layer in layers.items():
                for _ in range(min(LONG_ROUND, args.long_steps)):
                    start = time.perf_counter()
                    native.paged_decode(q, layer, pages, lens, key_start, positions, dim ** -0.5, None, None)
                    best[name] = min(best[name], time.perf_counter() - start)
    result: dict = {}
    for name, layer in layers.items():
        result[f"decode_attention_seconds_{name}"] = round(best[name], 6)
        result[f"kv_bytes_read_{name}"] = layer[pages.view(-1)].numel() * layer.element_size()
    result["decode_attention_int8_vs_bf16"] = round(
        result["decode_attention_seconds_int8"] / result["decode_attention_seconds_bf16"], 3)
    result["decode_attention_fp8_vs_bf16"] = round(
        result["decode_attention_seconds_fp8"] / result["decode_attention_seconds_bf16"], 3)
    return result


PEER_KV_TYPES = ("q8_0", "f16")  # llama.cpp's K/V types timed: int8's counterpart, and its default
KV_TYPE_BYTES = {"q8_0": 34 / 32, "f16": 2.0}  # bytes per value: q8_0 blocks are 32 codes and a half scale


def against_llama_cpp(args: argparse.Namespace) -> dict:
    """The capacity workload on the benchmarks' random Llama (a llama.cpp architecture):
    ``--peer-documents`` documents, mmkv with int8 KV in the bytes of llama.cpp's q8_0 slots,
    llama.cpp with q8_0 and with f16 K and V served as llama-server serves ``--batch`` parallel
    slots with its prompt cache (``LlamaCpp.serve_slots``), the three taking turns."""
    missing = llama_cpp_peer.available()
    if missing is not None:
        return {"llama_cpp": missing}
    rounds = workload(list(range(BENCH_LLAMA["vocab_size"])), args.peer_documents, args)
    slot_tokens = args.document_tokens + 4 + args.answer
    head_dim = BENCH_LLAMA["hidden_size"] // BENCH_LLAMA["num_attention_heads"]
    values = BENCH_LLAMA["num_hidden_layers"] * 2 * BENCH_LLAMA["num_key_value_heads"] * head_dim
    kv_bytes = {kv: int(args.batch * slot_tokens * values * KV_TYPE_BYTES[kv]) for kv in PEER_KV_TYPES}
    with tempfile.TemporaryDirectory() as tmp:
        model = save_random_llama(Path(tmp) / "llama", args.seed)
        gguf = llama_cpp_peer.convert(model, Path(tmp) / "gguf", ["f32"])["f32"]
        peers = {kv: llama_cpp_peer.LlamaCpp(gguf, args.batch, slot_tokens, kv_type=kv) for kv in PEER_KV_TYPES}
        try:
            runs = _take_turns(peers, model, kv_bytes["q8_0"], rounds, args)
        finally:
            for peer in peers.values():
                peer.close()
    return {"llama_cpp": "timed", **{f"peer_kv_bytes_{kv}": n for kv, n in kv_bytes.items()},
            **_peer_figures(runs)}


@dataclass(slots=True)
class SideRun:
    """One side's runs: seconds per round; its last round's answers and prompt tokens served
    from its cache."""

    seconds: list[float] = field(default_factory=list)
    answers: list = field(default_factory=list)
    cached: int = 0


def _take_turns(peers: dict, model: Path, memory: int, rounds: list[list[list[int]]],
                args: argparse.Namespace) -> dict[str, SideRun]:
    """mmkv int8 (a fresh engine each round) and each llama.cpp peer serve the workload in turns,
    ``args.repeats`` rounds in rotated orders."""
    batches = in_batches(rounds, args.batch)
    sides = ["mmkv_int8", *(f"llama_cpp_{kv}" for kv in peers)]
    runs = {side: SideRun() for side in sides}
    for order in rotated(sides, args.repeats):
        for side in order:
            if side == "mmkv_int8":
                engine = Engine(model, kv_cache_memory=memory, host_kv_memory="16MiB", device="cpu",
                                dtype="float32", kv_cache_dtype="int8")
                answers, seconds = serve(engine, rounds, args)
                cached = engine.stats()["cached_prompt_tokens"]
            else:
                with gc_paused():
                    start = time.perf_counter()
                    answers, cached = peers[side.removeprefix("llama_cpp_")].serve_slots(batches, args.answer)
                    seconds = time.perf_counter() - start
            run = runs[side]
            run.seconds.append(seconds)
            run.answers, run.cached = answers, cached
    return runs


def _peer_figures(runs: dict[str, SideRun]) -> dict:
    """Each side's fastest seconds and cached prompt tokens; the medians of the rounds' ratios;
    how often mmkv's answers equal each peer's."""
    ours = runs["mmkv_int8"]

    def median_ratio(slow: SideRun, fast: SideRun) -> float:
        return round(statistics.median(s / f for s, f in zip(slow.seconds, fast.seconds)), 3)

    out: dict = {}
    for side, run in runs.items():
        out[f"{side}_seconds"] = round(min(run.seconds), 3)
        out[f"{side}_cached_prompt_tokens"] = run.cached
    for kv in PEER_KV_TYPES:
        peer = runs[f"llama_cpp_{kv}"]
        out[f"speedup_int8_vs_llama_cpp_{kv}_kv"] = median_ratio(peer, ours)
        out[f"greedy_agreement_with_llama_cpp_{kv}"] = round(
            sum(a == b for a, b in zip(ours.answers, peer.answers)) / len(ours.answers), 4)
    out["llama_cpp_q8_0_vs_f16_seconds"] = median_ratio(runs["llama_cpp_q8_0"], runs["llama_cpp_f16"])
    return out


def run(args: argparse.Namespace) -> dict:
    peer = against_llama_cpp(args) if "llama.cpp" in args.peers else {}
    return {**capacity(args), **long_decode(args), **peer}
