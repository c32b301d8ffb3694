"""FlashInfer against the torch backend on a GPU, and mmkv against transformers there.

* ``decode``: ``--batch`` sequences of ``--prompt`` random tokens (nothing shared, prefix caching
  off) and ``--new`` greedy tokens each, on a random Llama with head_dim 128 (hidden 1024, 8 heads,
  2 KV heads, 8 layers, bfloat16): decode tokens/s of the torch and FlashInfer backends. Decode
  time is a ``--new``-token run minus a one-token run (prefill and first token).
* ``cascade``: ``--shared-batch`` sequences sharing a ``--shared-prefix``-token prefix (plus 16
  tokens each), ``--new`` tokens, the prefix cached before timing: decode tokens/s with
  shared-prefix (cascade) attention on and off, for each backend.
* ``prefix``, ``image-qa``: those benchmarks on the GPU against transformers, both sides in
  float32 on the torch backend (their outputs must be equal).

bfloat16 rounding can flip a near-tie, so the bfloat16 outputs are checked against transformers'
float32 logits on the same tokens (every token the argmax up to ``NEAR_TIE`` standard deviations of
its position's logits): ``outputs_near_greedy``; ``token_agreement`` is the share of sequences on
which FlashInfer and the torch backend agree token for token.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from mmkv import Engine, SamplingParams
from mmkv.bench import image_qa_bench, prefix_bench, timed
from mmkv.bench.random_models import save_random_llama
from mmkv.bench.variants import NoCascadeEngine

HEAD128 = dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=8, num_key_value_heads=2,
               max_position_embeddings=8192)
BACKENDS = ("torch", "flashinfer")
NEAR_TIE = 0.5  # the tests' bound (tests/devices.py)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=int, default=64, help="decode: sequences")
    p.add_argument("--prompt", type=int, default=512, help="decode: prompt tokens")
    p.add_argument("--new", type=int, default=64, help="tokens generated per sequence")
    p.add_argument("--shared-batch", type=int, default=64, help="cascade: sequences")
    p.add_argument("--shared-prefix", type=int, default=4096, help="cascade: shared prefix tokens")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)


def _engine(model_dir: Path, backend: str, block_size: int, cascade: bool = True,
            enable_prefix_caching: bool = True) -> Engine:
    engine_class = Engine if cascade else NoCascadeEngine
    return engine_class(model_dir, device="cuda", dtype="bfloat16", kv_cache_memory="8GiB",
                        host_kv_memory="64MiB", block_size=block_size, attention_backend=backend,
                        max_num_batched_tokens=8192, enable_prefix_caching=enable_prefix_caching)


def decode_seconds(engine: Engine, prompts: list[list[int]], new: int) -> tuple[list[list[int]], float]:
    """Outputs of ``new`` tokens per prompt and the time of all but the first (the same run with
    one token subtracted); a one-token run first warms up (and, with caching, caches the prompts)."""
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    engine.generate(prompts, one)
    _, first = timed(lambda: engine.generate(prompts, one))
    outs, total = timed(lambda: engine.generate(prompts, SamplingParams(max_tokens=new, ignore_eos=True)))
    return [o.token_ids for o in outs], total - first


@torch.inference_mode()
def worst_deficit(model, prompts: list[list[int]], outputs: list[list[int]]) -> float:
    """The largest distance, over every generated token, below its position's float32 argmax, in
    standard deviations of that position's logits (0 when every token is the argmax)."""
    worst = 0.0
    for prompt, tokens in zip(prompts, outputs):
        ids = torch.tensor([prompt + tokens], device=model.device)
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
        chosen = logits[torch.arange(len(tokens)), torch.tensor(tokens, device=model.device)]
        worst = max(worst, float(((logits.max(-1).values - chosen) / logits.std(-1)).max()))
    return worst


def _defaults(bench, *argv: str) -> argparse.Namespace:
    """A benchmark's arguments: its defaults (the README's sizes) but for ``argv``."""
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(list(argv))


def run(args: argparse.Namespace) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("python -m mmkv.bench gpu needs a CUDA device")
    rng = np.random.default_rng(args.seed)
    result: dict = {"device": torch.cuda.get_device_name()}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_random_llama(Path(tmp) / "llama", seed=args.seed, **HEAD128)
        prompts = [rng.integers(0, 8000, size=args.prompt).tolist() for _ in range(args.batch)]
        prefix = rng.integers(0, 8000, size=args.shared_prefix).tolist()
        shared = [prefix + rng.integers(0, 8000, size=16).tolist() for _ in range(args.shared_batch)]
        outputs: dict[str, list[list[int]]] = {}
        for backend in BACKENDS:
            engine = _engine(model_dir, backend, args.block_size, enable_prefix_caching=False)
            outputs[f"decode_{backend}"], seconds = decode_seconds(engine, prompts, args.new)
            result[f"decode_tokens_per_s_{backend}"] = round(args.batch * (args.new - 1) / seconds, 1)
            del engine
            for cascade in (True, False):
                engine = _engine(model_dir, backend, args.block_size, cascade=cascade)
                name = f"{backend}_{'cascade' if cascade else 'no_cascade'}"
                outputs[f"shared_{name}"], seconds = decode_seconds(engine, shared, args.new)
                result[f"shared_prefix_tokens_per_s_{name}"] = round(
                    args.shared_batch * (args.new - 1) / seconds, 1)
                del engine
        result["decode_speedup_flashinfer_vs_torch"] = round(
            result["decode_tokens_per_s_flashinfer"] / result["decode_tokens_per_s_torch"], 2)
        for backend in BACKENDS:
            result[f"cascade_speedup_{backend}"] = round(
                result[f"shared_prefix_tokens_per_s_{backend}_cascade"]
                / result[f"shared_prefix_tokens_per_s_{backend}_no_cascade"], 2)
        result["token_agreement"] = {
            case: round(float(np.mean([a == b for a, b in zip(outputs[f"{case}_torch{sfx}"],
                                                                 outputs[f"{case}_flashinfer{sfx}"])])), 3)
            for case, sfx in (("decode", ""), ("shared", "_cascade"))}
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to("cuda").eval()
        worst = {name: round(worst_deficit(model, prompts if name.startswith("decode") else shared, outs), 3)
                 for name, outs in outputs.items()}
        del model
    result["worst_deficit_std"] = worst
    result["outputs_near_greedy"] = max(worst.values()) <= NEAR_TIE
    prefix = prefix_bench.run(_defaults(prefix_bench, "--device", "cuda"))
    image_qa = image_qa_bench.run(_defaults(image_qa_bench, "--device", "cuda"))
    result.update({f"prefix_{k}": v for k, v in prefix.items()})
    result.update({f"image_qa_{k}": v for k, v in image_qa.items()})
    result["outputs_equal"] = prefix["outputs_equal"] and image_qa["outputs_equal"]
    return result
