"""N questions over one shared P-token prefix: mmkv against transformers' generate.

A random Llama (hidden 512, 8 layers, 8 heads, 4 KV heads, vocab 8000, fp32) answers ``--n``
questions of ``--q`` tokens that all follow the same ``--p``-token prefix, ``--a`` greedy tokens
each (EOS ignored). In the same run and on the same weights: mmkv (one ``generate`` call, cold
cache), mmkv without cascade attention, transformers' batched ``generate`` (all prompts padded into
one batch) and sequential ``generate`` (one prompt at a time). Outputs must be equal. On the CPU
in float32 it also times mmkv in bfloat16 and, with ``--peers llama.cpp``, llama.cpp on the same
weights (GGUF f32 and f16; see ``llama_cpp_peer``). Timings are the best of ``--repeats`` runs.
``--device cuda`` runs both sides on the GPU (in ``--dtype``, mmkv on ``--attention-backend``).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from mmkv import Engine, SamplingParams
from mmkv.bench import llama_cpp_peer, timed
from mmkv.bench.random_models import BENCH_LLAMA, save_random_llama, text_size
from mmkv.bench.variants import NoCascadeEngine


SWEEP_N = "4,16,64"
SWEEP_P = "300,1200,4800"
WARM_UP = [7, 7, 7]  # every side's warm-up prompt: shorter than a block, it leaves nothing to share
HF_SWEEP_TOKENS = 20_000  # transformers' padded batch attends with a dense mask: skip beyond this


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
    p.add_argument("--repeats", type=int, default=3,
                   help="timed runs of mmkv, transformers batched and each peer; the fastest counts")
    p.add_argument("--peers", default="", help="also time llama.cpp (`make bench-peers` installs it)")
    p.add_argument("--sweep", action="store_true",
                   help="instead: seconds for every N of --sweep-n questions and P of --sweep-p "
                        "prefix tokens, mmkv against transformers batched (and llama.cpp), charted")
    p.add_argument("--sweep-n", default=SWEEP_N)
    p.add_argument("--sweep-p", default=SWEEP_P)
    p.add_argument("--chart", type=Path, default=Path("prefix_scaling.png"))
    add_device_arguments(p)


def add_device_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help="cpu or cuda (both sides)")
    p.add_argument("--dtype", default="float32", help="both sides' dtype")
    p.add_argument("--attention-backend", default="auto", help="mmkv's: auto, torch or flashinfer")


def workload(n: int, p: int, q: int, seed: int) -> tuple[list[int], list[list[int]]]:
    """A ``p``-token prefix and ``n`` prompts of it followed by ``q`` tokens of their own."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, 8000, size=p).tolist()
    return prefix, [prefix + rng.integers(0, 8000, size=q).tolist() for _ in range(n)]


def unique_prefixes(prompts: list[list[int]]) -> int:
    """Tokens a perfect prefix cache computes: the number of distinct prompt prefixes."""
    return len({tuple(p[: i + 1]) for p in prompts for i in range(len(p))})


def run_mmkv_once(model_dir: Path, prompts, params, args: argparse.Namespace,
                  engine_class: type[Engine] = Engine, **options):
    """mmkv's outputs and time on a fresh engine (so a cold cache), and the engine."""
    options = {"dtype": args.dtype, **options}
    engine = engine_class(model_dir, kv_cache_memory="512MiB", host_kv_memory="64MiB",
                    block_size=args.block_size, device=args.device,
                    attention_backend=args.attention_backend, **options)
    engine.generate([WARM_UP], SamplingParams(max_tokens=2))
    outs, seconds = timed(lambda: engine.generate(prompts, params))
    return [o.token_ids for o in outs], seconds, engine


def run_mmkv(model_dir: Path, prompts, params, args: argparse.Namespace,
             engine_class: type[Engine] = Engine, **options):
    """mmkv's outputs, its best time of ``--repeats`` runs (a fresh engine each time) and the last
    engine."""
    best = None
    for _ in range(args.repeats):  # one engine alive at a time: each holds its KV pool
        outs, seconds, engine = run_mmkv_once(model_dir, prompts, params, args, engine_class, **options)
        if best is None or seconds < best[1]:
            best = outs, seconds
    return best[0], best[1], engine


def best_of(repeats: int, fn):
    """``fn()``'s result and its fastest time over ``repeats`` runs."""
    runs = [timed(fn) for _ in range(repeats)]
    return runs[-1][0], min(seconds for _, seconds in runs)


@torch.inference_mode()
def hf_prefix_reuse(model, prefix: list[int], prompts: list[list[int]], new_tokens: int,
                    prefix_inputs: dict | None = None, **generate_kwargs) -> list[list[int]]:
    """transformers with its documented prefix caching, in one batch: the shared prefix prefilled
    once into a ``DynamicCache`` (logits of its last position only), the cache repeated for every
    prompt, and one batched ``generate`` that computes only what follows the prefix. The prompts
    are the prefix and suffixes of one length (no padding to move the prefix). ``prefix_inputs``:
    the prefix pass's other inputs (an image's pixels); ``generate_kwargs``: ``generate``'s."""
    if len({len(p) for p in prompts}) != 1 or any(p[:len(prefix)] != prefix for p in prompts):
        raise ValueError("prefix reuse needs prompts of one length that all start with the prefix")
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([prefix], device=model.device), **(prefix_inputs or {}), cache=cache,
          logits_to_keep=1)
    cache.batch_repeat_interleave(len(prompts))
    ids = torch.tensor(prompts, device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache,
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                         pad_token_id=0, **generate_kwargs)
    return out[:, ids.shape[1]:].tolist()


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
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be at least 1, got {args.repeats}")
    if args.sweep:
        return sweep(args)
    prefix, prompts = workload(args.n, args.p, args.q, args.seed)
    params = SamplingParams(max_tokens=args.a, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_random_llama(Path(tmp) / "llama", seed=args.seed,
                                      **text_size(args.hidden_size, args.num_layers))
        ours, mmkv_s, engine = run_mmkv(model_dir, prompts, params, args)
        no_cascade, no_cascade_s, _ = run_mmkv(model_dir, prompts, params, args, NoCascadeEngine)
        single, single_s, _ = run_mmkv(model_dir, prompts[:1], params, args,
                                       enable_prefix_caching=False)
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, args.dtype)).to(args.device).eval()
        hf_generate(model, [WARM_UP], 2)
        hf_prefix_reuse(model, WARM_UP, [WARM_UP + [1], WARM_UP + [2]], 2)
        batched, batched_s = best_of(args.repeats, lambda: hf_generate(model, prompts, args.a))
        reused, reused_s = best_of(args.repeats, lambda: hf_prefix_reuse(model, prefix, prompts, args.a))
        sequential, sequential_s = best_of(
            args.repeats, lambda: [hf_generate(model, [p], args.a)[0] for p in prompts])
        result = {}
        if args.device == "cpu" and args.dtype == "float32":
            result.update(bfloat16_and_peers(model_dir, prefix, prompts, params, ours, mmkv_s, args))
    stats = engine.stats()
    bytes_per_block = engine.kv.bytes_per_block
    unique = unique_prefixes(prompts)
    bound = (unique + args.n * args.a) * bytes_per_block // args.block_size
    return {
        "speedup_vs_hf_prefix_reuse": round(reused_s / mmkv_s, 2),
        "speedup_vs_hf_batched": round(batched_s / mmkv_s, 2),
        "speedup_vs_hf_sequential": round(sequential_s / mmkv_s, 2),
        "outputs_equal": (ours == batched == reused == sequential == no_cascade
                          and single == sequential[:1]),
        **result,
        "computed_prefill_tokens": stats["computed_prefill_tokens"] - 3,  # minus the warm-up
        "unique_tokens": unique,
        "kv_bytes_peak": stats["peak_kv_bytes"],
        "kv_bytes_unique_bound": bound,
        "kv_peak_goal_bytes": int(1.1 * bound) + args.n * bytes_per_block,
        "cascade_speedup": round(no_cascade_s / mmkv_s, 2),
        "single_request_speedup_vs_hf": round((sequential_s / args.n) / single_s, 2),
        "mmkv_seconds": round(mmkv_s, 3),
        "mmkv_no_cascade_seconds": round(no_cascade_s, 3),
        "hf_prefix_reuse_seconds": round(reused_s, 3),
        "hf_batched_seconds": round(batched_s, 3),
        "hf_sequential_seconds": round(sequential_s, 3),
        "n": args.n, "p": args.p, "q": args.q, "a": args.a, "repeats": args.repeats,
        "device": args.device, "dtype": args.dtype, "attention_backend": engine.attention.name,
    }


def bfloat16_and_peers(model_dir: Path, prefix: list[int], prompts: list[list[int]], params,
                       ours: list[list[int]], mmkv_s: float, args: argparse.Namespace) -> dict:
    """mmkv in bfloat16, and llama.cpp (f32 and f16 weights) when ``--peers llama.cpp``: seconds,
    speedups and how many sequences agree token for token with mmkv's float32 output (random
    weights have near-ties, which half precision flips). Each llama.cpp run alternates with an mmkv
    run in the matching precision (fp32 with f32, bf16 with f16) and the speedup is the ratio of
    their best times: the machine's speed drifts over a run of the bench, and two sides timed
    seconds apart can meet different speeds, one side alone a slow stretch."""
    bf16, bf16_s, _ = run_mmkv(model_dir, prompts, params, args, dtype="bfloat16")
    result = {"mmkv_bf16_seconds": round(bf16_s, 3),
              "bf16_speedup_vs_fp32": round(mmkv_s / bf16_s, 2),
              "bf16_sequences_equal_fp32": agreement(bf16, ours)}
    if "llama.cpp" not in args.peers:
        return result
    missing = llama_cpp_peer.available()
    if missing is not None:
        return {**result, "llama_cpp": missing}
    ggufs = llama_cpp_peer.convert(model_dir, model_dir.parent / "gguf", ["f32", "f16"])
    suffixes = [p[len(prefix):] for p in prompts]
    for outtype, dtype, label in (("f32", "float32", "speedup_vs_llama_cpp_f32"),
                                  ("f16", "bfloat16", "speedup_bf16_vs_llama_cpp_f16")):
        peer = llama_cpp_peer.LlamaCpp(ggufs[outtype], len(prompts), max(map(len, prompts)) + args.a)
        peer.generate_shared_prefix(prefix[:8], suffixes[:2], 2)  # warm-up
        mine_s, theirs_s = [], []
        for _ in range(args.repeats):  # run for run, so a slow stretch of the machine meets both
            mine_s.append(run_mmkv_once(model_dir, prompts, params, args, dtype=dtype)[1])
            theirs, seconds = timed(lambda: peer.generate_shared_prefix(prefix, suffixes, args.a))
            theirs_s.append(seconds)
        peer.close()
        result.update({f"llama_cpp_{outtype}_seconds": round(min(theirs_s), 3),
                       f"mmkv_{dtype}_seconds_beside_llama_cpp": round(min(mine_s), 3),
                       label: round(min(theirs_s) / min(mine_s), 2),
                       f"llama_cpp_{outtype}_sequences_equal_mmkv_fp32": agreement(theirs, ours)})
    return result


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> str:
    return f"{sum(a == b for a, b in zip(outputs, reference))}/{len(reference)}"


def sweep(args: argparse.Namespace) -> dict:
    """How cost grows with the work: every (N, P) cell once per system, drawn to ``args.chart``."""
    cells: dict[str, dict[str, float | str]] = {}
    sizes_n = [int(n) for n in args.sweep_n.split(",")]
    sizes_p = [int(p) for p in args.sweep_p.split(",")]
    params = SamplingParams(max_tokens=args.a, ignore_eos=True)
    missing = llama_cpp_peer.available() if "llama.cpp" in args.peers else "not asked for"
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_random_llama(Path(tmp) / "llama", seed=args.seed,
                                      **text_size(args.hidden_size, args.num_layers))
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        hf_generate(model, [WARM_UP], 2)
        hf_prefix_reuse(model, WARM_UP, [WARM_UP + [1], WARM_UP + [2]], 2)
        gguf = None
        if missing is None:
            gguf = llama_cpp_peer.convert(model_dir, Path(tmp) / "gguf", ["f32"])["f32"]
        for n in sizes_n:
            for p in sizes_p:
                prefix, prompts = workload(n, p, args.q, args.seed)
                ours, mmkv_s, _ = run_mmkv(model_dir, prompts, params, args)
                cell: dict[str, float | str] = {"mmkv": round(mmkv_s, 3)}
                if n * (p + args.q) <= HF_SWEEP_TOKENS:
                    theirs, hf_s = best_of(args.repeats, lambda: hf_generate(model, prompts, args.a))
                    cell["hf_batched"] = round(hf_s, 3)
                    cell["outputs_equal_hf"] = theirs == ours
                reused, reused_s = best_of(args.repeats,
                                           lambda: hf_prefix_reuse(model, prefix, prompts, args.a))
                cell["hf_prefix_reuse"] = round(reused_s, 3)
                cell["outputs_equal_hf_prefix_reuse"] = reused == ours
                if gguf is not None:
                    peer = llama_cpp_peer.LlamaCpp(gguf, n, p + args.q + args.a)
                    suffixes = [q[p:] for q in prompts]
                    theirs, peer_s = best_of(args.repeats, lambda: peer.generate_shared_prefix(
                        prefix, suffixes, args.a))
                    peer.close()
                    cell["llama_cpp_f32"] = round(peer_s, 3)
                    cell["llama_cpp_sequences_equal"] = agreement(theirs, ours)
                cells[f"n{n}_p{p}"] = cell
    _chart(cells, sizes_n, sizes_p, args)
    equal = [c[k] for c in cells.values() for k in ("outputs_equal_hf", "outputs_equal_hf_prefix_reuse")
             if k in c]
    return {"sweep": cells, "outputs_equal": all(equal), "llama_cpp": missing or "timed",
            "hf_skipped_beyond_tokens": HF_SWEEP_TOKENS, "q": args.q, "a": args.a,
            "repeats": args.repeats}


def _chart(cells: dict, sizes_n: list[int], sizes_p: list[int], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(sizes_n), figsize=(4 * len(sizes_n), 3.6), sharey=True,
                             squeeze=False)
    axes = axes[0]
    for ax, n in zip(axes, sizes_n):
        for system, label, style, color in (("mmkv", "mmkv", "o-", "C0"),
                                            ("hf_batched", "transformers batched", "s--", "C1"),
                                            ("hf_prefix_reuse", "transformers, prefix cache reused",
                                             "d-.", "C3"),
                                            ("llama_cpp_f32", "llama.cpp f32", "^:", "C2")):
            points = [(p, cells[f"n{n}_p{p}"][system]) for p in sizes_p if system in cells[f"n{n}_p{p}"]]
            if points:
                ax.plot(*zip(*points), style, color=color, label=label)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.minorticks_off()
        ax.set_xticks(sizes_p, [str(p) for p in sizes_p])
        ax.legend(fontsize="small")
        ax.set_title(f"{n} questions")
        ax.set_xlabel("shared prefix tokens")
    axes[0].set_ylabel("seconds")
    fig.suptitle(f"shared-prefix Q&A, random Llama (hidden {args.hidden_size}, {args.num_layers} "
                 f"layers), fp32, {args.q}-token questions, {args.a} answer tokens")
    fig.tight_layout()
    fig.savefig(args.chart, dpi=100)
