"""Speculative decoding on the bundled model: plain decoding against early exit (and a draft
model when one is given), at batch 1 and batch 8, with transformers' assisted generation on the
same weights as the peer.

Workloads: scene descriptions (``describe the scene.``, ~46 answer tokens) and document summaries
(``summarise the report.``, ~25 tokens), greedy. transformers runs the document summaries (its
Mllama text model takes no image without the cross-attention plumbing), at batch 1, the only
batch size its assisted generation supports. Every greedy variant must give the same outputs.
Every timing is the best of ``--repeats`` runs (mmkv on a fresh engine each time), taken with the
garbage collector paused (``mmkv.bench.timed``).
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mmkv import Engine, SamplingParams
from mmkv.bench import timed
from mmkv.engine import BUNDLED_MODEL, BUNDLED_SPECULATION
from mmkv.models import MmkvVLM
from mmkv.models.base import read_config_json
from mmkv.speculation import SpeculationStats
from mmkv.synthetic import document_prompt, random_report, random_scene, scene_prompt
from speculative import SpeculativeConfig

PARAMS = SamplingParams(max_tokens=48)
DRAFT_MODEL = BUNDLED_MODEL.parent / "tiny-draft"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, default=BUNDLED_MODEL)
    p.add_argument("--draft", type=Path, default=DRAFT_MODEL)
    p.add_argument("--requests", type=int, default=16, help="per workload")
    p.add_argument("--num-tokens", type=int, default=BUNDLED_SPECULATION["num_tokens"],
                   help="most draft tokens per round")
    p.add_argument("--early-exit-layer", type=int, default=None,
                   help="draft depth for early exit (default: the model's early_exit_layer)")
    p.add_argument("--adaptive-threshold", type=float, default=BUNDLED_SPECULATION["adaptive_threshold"],
                   help="stop a round's drafting once the draft's top probability falls below this "
                        "(transformers' assisted generation stops at 0.4 by default); 0: never")
    p.add_argument("--sweep", default="1,2,4,8,12,16,24,32", help="draft lengths for the chart")
    p.add_argument("--chart", type=Path, default=Path("spec_speedup.png"))
    p.add_argument("--repeats", type=int, default=3,
                   help="runs of every timed variant; the fastest counts (timings here vary by ~10%%)")
    p.add_argument("--seed", type=int, default=11)


def workloads(n: int, seed: int) -> dict[str, list]:
    rng = random.Random(seed)
    scenes = [{"prompt": scene_prompt("describe the scene."), "images": [random_scene(rng).render()]}
              for _ in range(n)]
    docs = [document_prompt(random_report(rng), "summarise the report.") for _ in range(n)]
    return {"scenes": scenes, "documents": docs}


def timed_mmkv(model: Path, prompts: list, batch: int, speculative: SpeculativeConfig | None,
               repeats: int):
    """Generated tokens, seconds and stats for ``prompts`` served ``batch`` at a time: the best of
    ``repeats`` runs, each on a fresh engine (so a fresh cache)."""
    best = None
    for _ in range(repeats):
        engine = Engine(model, kv_cache_memory="256MiB", host_kv_memory="16MiB", speculative=speculative)
        engine.generate(prompts[:1], SamplingParams(max_tokens=4))  # warm-up
        outs, seconds = timed(lambda: [o for i in range(0, len(prompts), batch)
                                       for o in engine.generate(prompts[i:i + batch], PARAMS)])
        if best is None or seconds < best[1]:
            best = [o.token_ids for o in outs], seconds, engine.stats()
    return best


@torch.inference_mode()
def timed_hf(target, prompts: list[str], tokenizer, repeats: int, **assist):
    """transformers' generate on each prompt in turn: outputs and the best of ``repeats`` timings."""
    eos = tokenizer.eos_token_id
    target.generate(torch.tensor([tokenizer.encode(prompts[0])]), max_new_tokens=2, **assist)

    def generate_all() -> list[list[int]]:
        outs = []
        for p in prompts:
            ids = torch.tensor([tokenizer.encode(p)])
            out = target.generate(ids, max_new_tokens=PARAMS.max_tokens, do_sample=False,
                                  eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, **assist)
            outs.append(out[0, ids.shape[1]:].tolist())
        return outs

    runs = [timed(generate_all) for _ in range(repeats)]
    return runs[0][0], min(seconds for _, seconds in runs)


def tokens(outs: list[list[int]]) -> int:
    return sum(len(o) for o in outs)


def run(args: argparse.Namespace) -> dict:
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be at least 1, got {args.repeats}")
    loads = workloads(args.requests, args.seed)
    everything = loads["scenes"] + loads["documents"]
    configs = {"plain": None, "early_exit": _early_exit(args, args.num_tokens)}
    if args.draft.exists():
        configs["draft"] = SpeculativeConfig(method="draft_model", num_tokens=args.num_tokens,
                                             draft_model=args.draft,
                                             adaptive_threshold=args.adaptive_threshold or None)
    result: dict = {}
    outputs: dict[str, list] = {}
    ours: dict = {}  # batch-1 document runs: what transformers also serves
    for batch in (1, 8):
        rates = {}
        for name, config in configs.items():
            per_load = {load: timed_mmkv(args.model, prompts, batch, config, args.repeats)
                        for load, prompts in loads.items()}
            outs = [o for load in loads for o in per_load[load][0]]
            seconds = sum(s for _, s, _ in per_load.values())
            stats = _merged_stats([st for _, _, st in per_load.values()])
            outputs[f"{name}_b{batch}"] = outs
            if batch == 1:
                ours[name] = per_load["documents"]
            rates[name] = tokens(outs) / seconds
            for load, (o, s, _) in per_load.items():
                rates[f"{name}_{load}"] = tokens(o) / s
            result[f"tokens_per_s_{name}_b{batch}"] = round(rates[name], 1)
            result[f"peak_blocks_{name}_b{batch}"] = max(st["peak_blocks_in_use"]
                                                         for _, _, st in per_load.values())
            if config is not None:
                result[f"speedup_{name}_b{batch}"] = round(rates[name] / rates["plain"], 2)
                for load in loads:
                    result[f"speedup_{name}_{load}_b{batch}"] = round(
                        rates[f"{name}_{load}"] / rates[f"plain_{load}"], 2)
                result[f"acceptance_rate_{name}_b{batch}"] = stats["spec_acceptance_rate"]
                result[f"mean_tokens_per_round_{name}_b{batch}"] = stats["spec_mean_tokens_per_round"]
                result[f"target_passes_{name}_b{batch}"] = stats["spec_rounds"]
    result["acceptance_rate_early_exit"] = result["acceptance_rate_early_exit_b1"]
    # Blocks the early-exit draft holds beyond plain decoding at the peak of the same workload:
    # its K/V is the target's own, so only the slots reserved for a round's drafts count.
    result["draft_extra_blocks_early_exit"] = (result["peak_blocks_early_exit_b8"]
                                               - result["peak_blocks_plain_b8"])

    # transformers on the same weights: the language model of the bundled VLM, document summaries.
    docs = loads["documents"]
    first_doc = len(loads["scenes"])
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    target = MmkvVLM.from_pretrained(args.model).language_model
    hf_plain, hf_plain_s = timed_hf(target, docs, tokenizer, args.repeats)
    hf = {}
    try:
        hf["hf_assisted_early_exit"] = timed_hf(target, docs, tokenizer, args.repeats,
                                                assistant_early_exit=_early_exit_layer(args.model))
    except (AttributeError, ValueError, TypeError) as err:  # not every model class supports it
        result["hf_assisted_early_exit_error"] = f"{type(err).__name__}: {err}"
    if args.draft.exists():
        draft = AutoModelForCausalLM.from_pretrained(args.draft).eval()
        hf["hf_assisted_draft"] = timed_hf(target, docs, tokenizer, args.repeats,
                                             assistant_model=draft)
    result["tokens_per_s_hf_plain_b1"] = round(tokens(hf_plain) / hf_plain_s, 1)
    for name, (outs, seconds) in hf.items():
        result[f"tokens_per_s_{name}_b1"] = round(tokens(outs) / seconds, 1)
    best_ours = max(tokens(o) / s for o, s, _ in ours.values())
    best_hf = max(tokens(o) / s for o, s in hf.values())
    result["speedup_vs_hf_plain_b1"] = round(best_ours / (tokens(hf_plain) / hf_plain_s), 2)
    result["speedup_vs_hf_assisted_b1"] = round(best_ours / best_hf, 2)
    for name in ("early_exit", "draft"):
        peer = {"early_exit": "hf_assisted_early_exit", "draft": "hf_assisted_draft"}[name]
        if name in ours and peer in hf:
            o, s, _ = ours[name]
            result[f"speedup_{name}_vs_{peer}_b1"] = round((tokens(o) / s) / (tokens(hf[peer][0]) / hf[peer][1]), 2)
    eos = tokenizer.eos_token_id
    reference = [_until_eos(o, eos) for o in hf_plain]
    mmkv_variants = list(outputs.values())
    docs_variants = [o[first_doc:] for o in mmkv_variants] + [o for o, _, _ in ours.values()] \
        + [o for o, _ in hf.values()]
    result["outputs_equal"] = (all(v == mmkv_variants[0] for v in mmkv_variants)
                               and all([_until_eos(x, eos) for x in v] == reference for v in docs_variants))
    result["sweep_early_exit_b1"] = _sweep(args, everything)
    result["requests_per_workload"] = args.requests
    result["settings"] = {"num_tokens": args.num_tokens,
                          "early_exit_layer": args.early_exit_layer or _early_exit_layer(args.model),
                          "adaptive_threshold": args.adaptive_threshold or None}
    return result


def _early_exit(args: argparse.Namespace, num_tokens: int) -> SpeculativeConfig:
    return SpeculativeConfig(num_tokens=num_tokens, early_exit_layer=args.early_exit_layer,
                             adaptive_threshold=args.adaptive_threshold or None)


def _merged_stats(stats: list[dict]) -> dict:
    """Speculation counters of several runs combined into one set of rates."""
    return SpeculationStats(rounds=sum(st.get("spec_rounds", 0) for st in stats),
                            drafted=sum(st.get("spec_drafted_tokens", 0) for st in stats),
                            accepted=sum(st.get("spec_accepted_tokens", 0) for st in stats)).as_dict()


def _until_eos(ids: list[int], eos: int) -> list[int]:
    return ids[: ids.index(eos) + 1] if eos in ids else ids


def _early_exit_layer(model: Path) -> int:
    return read_config_json(model)["early_exit_layer"]


def _sweep(args: argparse.Namespace, prompts: list) -> dict[str, float]:
    """Batch-1 speedup of early exit for each draft length; drawn to ``args.chart``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    subset = prompts[:: max(1, len(prompts) // 8)]
    _, plain_s, _ = timed_mmkv(args.model, subset, 1, None, args.repeats)
    gammas = [int(g) for g in args.sweep.split(",")]
    speedups = {}
    for g in gammas:
        _, s, _ = timed_mmkv(args.model, subset, 1, _early_exit(args, g), args.repeats)
        speedups[str(g)] = round(plain_s / s, 2)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(gammas, [speedups[str(g)] for g in gammas], marker="o", label="early exit, batch 1")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("draft tokens per round")
    ax.set_ylabel("speedup over plain decoding")
    ax.set_title("mmkv speculative decoding (bundled model)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.chart, dpi=100)
    return speedups
