"""N questions over one shared P-token prefix: mmkv against transformers' generate.

A random Llama (hidden 512, 8 layers, 8 heads, 4 KV heads, vocab 8000, fp32) answers ``--n``
questions of ``--q`` tokens that all follow the same ``--p``-token prefix, ``--a`` greedy tokens
each (EOS ignored). In the same run and on the same weights: mmkv (one ``generate`` call, cold
cache), mmkv without cascade attention, transformers' batched ``generate`` (all prompts padded into
one batch) and sequential ``generate`` (one prompt at a time). Outputs must be equal.
``--device cuda`` runs both sides on the GPU (in ``--dtype``, mmkv on ``--attention-backend``).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from mmkv import Engine, SamplingParams
from mmkv.bench import timed
from mmkv.bench.random_models import BENCH_LLAMA, save_random_llama, text_size


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--n", type=int, default=16, help="questions")
    p.add_argument("--p", type=int, default=600, help="shared prefix tokens")
    p.add_argument("--q", type=int, default=20, help="question tokens")
    p.add_argument("--a", type=int, default=16, help="answer tokens")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--hidden-size", type=int, default=BENCH_LLAMA["hidden_size"],
                   help="text model width (the figures in the README use the default)")
    p.add_argument("--num-layers", type=int, default=BENCH_LLAMA["num_hidden_layers"])
    p.add_argument("--seed", type=int, default=0)
    add_device_arguments(p)


def add_device_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help="cpu or cuda (both sides)")
    p.add_argument("--dtype", default="float32", help="both sides' dtype")
    p.add_argument("--attention-backend", default="auto", help="mmkv's: auto, torch or flashinfer")


def unique_prefixes(prompts: list[list[int]]) -> int:
    """Tokens a perfect prefix cache computes: the number of distinct prompt prefixes."""
    return len({tuple(p[: i + 1]) for p in prompts for i in range(len(p))})


def run_mmkv(model_dir: Path, prompts, params, args: argparse.Namespace, **options):
    engine = Engine(model_dir, kv_cache_memory="512MiB", host_kv_memory="64MiB",
                    block_size=args.block_size, device=args.device, dtype=args.dtype,
                    attention_backend=args.attention_backend, **options)
    engine.generate([[7, 7, 7]], SamplingParams(max_tokens=2))  # warm-up, shares nothing
    outs, seconds = timed(lambda: engine.generate(prompts, params))
    return [o.token_ids for o in outs], seconds, engine


@torch.inference_mode()
def hf_generate(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long, device=model.device)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding
        ids[i, width - len(p):] = torch.tensor(p, device=model.device)
        mask[i, width - len(p):] = 1
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[:, width:].tolist()


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(torch.get_num_threads())
    rng = np.random.default_rng(args.seed)
    prefix = rng.integers(0, 8000, size=args.p).tolist()
    prompts = [prefix + rng.integers(0, 8000, size=args.q).tolist() for _ in range(args.n)]
    params = SamplingParams(max_tokens=args.a, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_random_llama(Path(tmp) / "llama", seed=args.seed,
                                      **text_size(args.hidden_size, args.num_layers))
        ours, mmkv_s, engine = run_mmkv(model_dir, prompts, params, args)
        no_cascade, no_cascade_s, _ = run_mmkv(model_dir, prompts, params, args, cascade=False)
        single, single_s, _ = run_mmkv(model_dir, prompts[:1], params, args,
                                       enable_prefix_caching=False)
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, args.dtype)).to(args.device).eval()
        hf_generate(model, [[7, 7, 7]], 2)  # warm-up
        batched, batched_s = timed(lambda: hf_generate(model, prompts, args.a))
        sequential, sequential_s = timed(lambda: [hf_generate(model, [p], args.a)[0] for p in prompts])
    stats = engine.stats()
    bytes_per_block = engine.kv.bytes_per_block
    unique = unique_prefixes(prompts)
    bound = (unique + args.n * args.a) * bytes_per_block // args.block_size
    return {
        "speedup_vs_hf_batched": round(batched_s / mmkv_s, 2),
        "speedup_vs_hf_sequential": round(sequential_s / mmkv_s, 2),
        "outputs_equal": ours == batched == sequential == no_cascade and single == sequential[:1],
        "computed_prefill_tokens": stats["computed_prefill_tokens"] - 3,  # minus the warm-up
        "unique_tokens": unique,
        "kv_bytes_peak": stats["peak_kv_bytes"],
        "kv_bytes_unique_bound": bound,
        "kv_peak_goal_bytes": int(1.1 * bound) + args.n * bytes_per_block,
        "cascade_speedup": round(no_cascade_s / mmkv_s, 2),
        "single_request_speedup_vs_hf": round((sequential_s / args.n) / single_s, 2),
        "mmkv_seconds": round(mmkv_s, 3),
        "mmkv_no_cascade_seconds": round(no_cascade_s, 3),
        "hf_batched_seconds": round(batched_s, 3),
        "hf_sequential_seconds": round(sequential_s, 3),
        "n": args.n, "p": args.p, "q": args.q, "a": args.a,
        "device": args.device, "dtype": args.dtype, "attention_backend": engine.attention.name,
    }
