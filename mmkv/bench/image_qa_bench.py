"""Many questions about few images: mmkv against transformers' batched generate per image.

``--family mllama`` (default): a random Mllama (vision tower hidden 256, 4 local + 2 global layers,
224-pixel tiles, patch 14; text model the prefix benchmark's Llama with cross-attention at layers 3
and 7), 224-pixel images (one tile). ``--family qwen2_5_vl``: a random Qwen2.5-VL (text model of
the same sizes with M-RoPE; vision tower width 256, depth 4, patch 14, merge 2), 448-pixel images
(256 image tokens each; 224 pixels give 64).

The model answers ``--q`` questions about each of ``--i`` images, ``--a`` greedy tokens each. mmkv
gets every request in one ``generate`` call (cold cache); transformers gets one batched
``generate`` per image (the image repeated for each question, as its API needs). Each timing is
the best of ``--repeats`` runs (mmkv on a fresh engine, so a cold cache, each time). Outputs must be
equal. ``--device cuda`` runs both sides on the GPU (in ``--dtype``, mmkv on
``--attention-backend``).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import (AutoImageProcessor, MllamaForConditionalGeneration,
                          Qwen2_5_VLForConditionalGeneration)
from transformers.models.mllama.processing_mllama import (
    convert_sparse_cross_attention_mask_to_dense, get_cross_attention_token_mask)

from mmkv import Engine, SamplingParams
from mmkv.bench import timed
from mmkv.bench.prefix_bench import add_device_arguments
from mmkv.bench.random_models import (BENCH_LLAMA, MLLAMA_IMAGE_TOKEN, QWEN_VL_TOKENS,
                                      save_random_mllama, save_random_qwen2_5_vl, text_size)

FAMILIES = ("mllama", "qwen2_5_vl")
IMAGE_SIZES = {"mllama": 224, "qwen2_5_vl": 448}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--family", choices=FAMILIES, default="mllama")
    p.add_argument("--image-size", type=int, default=None,
                   help="square images of this many pixels a side (default: 224 for mllama, "
                        "448 for qwen2_5_vl)")
    p.add_argument("--i", type=int, default=4, help="images")
    p.add_argument("--q", type=int, default=16, help="questions per image")
    p.add_argument("--a", type=int, default=16, help="answer tokens")
    p.add_argument("--question-tokens", type=int, default=12)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--hidden-size", type=int, default=BENCH_LLAMA["hidden_size"],
                   help="text model width (the figures in the README use the default)")
    p.add_argument("--num-layers", type=int, default=BENCH_LLAMA["num_hidden_layers"])
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of each side; the fastest counts (for a machine shared with others)")
    p.add_argument("--seed", type=int, default=0)
    add_device_arguments(p)


@torch.inference_mode()
def mllama_answers(model, processor, image: Image.Image, prompts: list[list[int]],
                   new: int) -> list[list[int]]:
    inputs = processor(images=[[image]] * len(prompts), return_tensors="pt")
    tiles = [[int(m.sum()) for m in row] for row in inputs["aspect_ratio_mask"]]
    sparse = [get_cross_attention_token_mask(p, model.config.image_token_index) for p in prompts]
    mask = torch.tensor(convert_sparse_cross_attention_mask_to_dense(
        sparse, tiles, model.config.vision_config.max_num_tiles, len(prompts[0])))
    device = model.device
    out = model.generate(torch.tensor(prompts, device=device),
                         pixel_values=inputs["pixel_values"].to(device, model.dtype),
                         aspect_ratio_ids=inputs["aspect_ratio_ids"].to(device),
                         aspect_ratio_mask=inputs["aspect_ratio_mask"].to(device),
                         cross_attention_mask=mask.to(device),
                         max_new_tokens=new, min_new_tokens=new, do_sample=False)
    return out[:, len(prompts[0]):].tolist()


@torch.inference_mode()
def qwen_answers(model, processor, image: Image.Image, prompts: list[list[int]],
                 new: int) -> list[list[int]]:
    """The image pad expanded to the image's tokens, as Qwen's processor does; M-RoPE from
    ``mm_token_type_ids`` and ``image_grid_thw``."""
    inputs = processor(images=[image] * len(prompts), return_tensors="pt")
    grid = inputs["image_grid_thw"]
    pad = model.config.image_token_id
    tokens = int(grid[0].prod()) // model.config.vision_config.spatial_merge_size ** 2
    device = model.device
    ids = torch.tensor([[u for t in p for u in ([t] * tokens if t == pad else [t])] for p in prompts],
                       device=device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids),
                         mm_token_type_ids=(ids == pad).int(),
                         pixel_values=inputs["pixel_values"].to(device, model.dtype),
                         image_grid_thw=grid.to(device), max_new_tokens=new, min_new_tokens=new,
                         do_sample=False)
    return out[:, ids.shape[1]:].tolist()


IMAGE_PREFIX = {  # the tokens that stand for an image at the start of a question
    "mllama": [MLLAMA_IMAGE_TOKEN, 1],
    "qwen2_5_vl": [QWEN_VL_TOKENS["vision_start_token_id"], QWEN_VL_TOKENS["image_token_id"],
                   QWEN_VL_TOKENS["vision_end_token_id"]],
}
PEERS = {  # family: (save a random model, its transformers class, batched answers per image)
    "mllama": (save_random_mllama, MllamaForConditionalGeneration, mllama_answers),
    "qwen2_5_vl": (save_random_qwen2_5_vl, Qwen2_5_VLForConditionalGeneration, qwen_answers),
}


def timed_mmkv(model_dir: Path, requests: list[dict], params: SamplingParams, args):
    """Answers, the best of ``args.repeats`` timings (each on a fresh engine) and that engine;
    None for the answers if two runs disagree."""
    best = None
    for _ in range(args.repeats):
        engine = Engine(model_dir, kv_cache_memory="1GiB", host_kv_memory="64MiB",
                        block_size=args.block_size, device=args.device, dtype=args.dtype,
                        attention_backend=args.attention_backend)
        engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2))  # warm-up, text only
        ours, seconds = timed(lambda: [o.token_ids for o in engine.generate(requests, params)])
        if best is not None and ours != best[0]:
            return None, seconds, engine
        if best is None or seconds < best[1]:
            best = ours, seconds, engine
    return best


def run(args: argparse.Namespace) -> dict:
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be at least 1, got {args.repeats}")
    rng = np.random.default_rng(args.seed)
    size = args.image_size or IMAGE_SIZES[args.family]
    images = [Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8), "RGB")
              for _ in range(args.i)]
    save, hf_class, hf_answers = PEERS[args.family]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save(Path(tmp) / args.family, seed=args.seed,
                         **text_size(args.hidden_size, args.num_layers))
        questions = [IMAGE_PREFIX[args.family] + rng.integers(4, 7900, size=args.question_tokens).tolist()
                     for _ in range(args.q)]
        params = SamplingParams(max_tokens=args.a, ignore_eos=True)
        requests = [{"prompt": q, "images": [img]} for img in images for q in questions]
        ours, mmkv_s, engine = timed_mmkv(model_dir, requests, params, args)

        model = hf_class.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).to(args.device).eval()
        processor = AutoImageProcessor.from_pretrained(model_dir)
        hf_answers(model, processor, images[0], questions[:1], 2)  # warm-up
        runs = [timed(lambda: [a for img in images
                               for a in hf_answers(model, processor, img, questions, args.a)])
                for _ in range(args.repeats)]
        theirs, hf_s = runs[0][0], min(seconds for _, seconds in runs)
    stats = engine.stats()
    result = {
        "family": args.family,
        "speedup_vs_hf_batched": round(hf_s / mmkv_s, 2),
        "outputs_equal": all(answers == ours for answers, _ in runs) and ours == theirs,
        "encoder_calls": stats["encoder_calls"],
        "images": args.i,
        "image_size": size,
        "mmkv_seconds": round(mmkv_s, 3),
        "hf_batched_seconds": round(hf_s, 3),
        "questions_per_image": args.q,
        "answer_tokens": args.a,
        "device": args.device, "dtype": args.dtype, "attention_backend": engine.attention.name,
    }
    if engine.image_kv is not None:  # cross-attention: image K/V blocks, one copy per image
        bytes_per_block = engine.kv.bytes_per_block
        tokens = engine.model.max_tiles * engine.model.xattn_tokens_per_tile
        result["xattn_kv_bytes"] = stats["xattn_blocks_computed"] * bytes_per_block
        result["xattn_kv_bytes_unique_bound"] = args.i * -(-tokens // args.block_size) * bytes_per_block
    else:  # image tokens in the sequence: served from the cache after each image's first question
        result["prompt_tokens"] = stats["prompt_tokens"] - 3  # minus the warm-up
        result["cached_prompt_tokens"] = stats["cached_prompt_tokens"]
        result["computed_prefill_tokens"] = stats["computed_prefill_tokens"] - 3
    return result
