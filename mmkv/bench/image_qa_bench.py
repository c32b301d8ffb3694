"""Many questions about few images: mmkv against transformers' batched generate.

``--family mllama`` (default): a random Mllama (vision tower hidden 256, 4 local + 2 global layers,
224-pixel tiles, patch 14; text model the prefix benchmark's Llama with cross-attention at layers 3
and 7), 224-pixel images (one tile). ``--family qwen2_5_vl``: a random Qwen2.5-VL (text model of
the same sizes with M-RoPE; vision tower width 256, depth 4, patch 14, merge 2), 448-pixel images
(256 image tokens each; 224 pixels give 64).

The model answers ``--q`` questions about each of ``--i`` images, ``--a`` greedy tokens each. mmkv
gets every request in one ``generate`` call (cold cache). transformers is timed two ways, each
image repeated for each of its questions as its API needs: one batched ``generate`` per image,
and one ``generate`` over every request of every image; the faster is ``speedup_vs_hf_batched``'s
peer. For Mllama also with its cache reused (``mllama_prefix_reuse``: each image's prefix
prefilled once, the vision tower run once per image; ``speedup_vs_hf_prefix_reuse``). Every timing is the best of ``--repeats`` runs (mmkv on a fresh
engine, so a cold cache, each time). Outputs must be equal. ``--device cuda`` runs both sides on the GPU (in ``--dtype``, mmkv on
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
from mmkv.bench.prefix_bench import add_device_arguments, hf_prefix_reuse
from mmkv.bench.random_models import (BENCH_LLAMA, MLLAMA_IMAGE_TOKEN, QWEN_VL_TOKENS,
                                      save_random_mllama, save_random_qwen2_5_vl, text_size)

FAMILIES = ("mllama", "qwen2_5_vl")
WARM_UP = [5, 6, 7]  # mmkv's warm-up prompt: text only, shorter than a block, it leaves nothing to share
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
    p.add_argument("--repeats", type=int, default=3, help="runs of each side; the fastest counts")
    p.add_argument("--seed", type=int, default=0)
    add_device_arguments(p)


@torch.inference_mode()
def mllama_answers(model, processor, images: list[Image.Image], prompts: list[list[int]],
                   new: int) -> list[list[int]]:
    """One batched ``generate``: prompt ``i`` about image ``i``."""
    inputs = processor(images=[[image] for image in images], return_tensors="pt")
    tiles = [[int(m.sum()) for m in row] for row in inputs["aspect_ratio_mask"]]
    mask = _mllama_mask(model, prompts, tiles)
    device = model.device
    out = model.generate(torch.tensor(prompts, device=device),
                         pixel_values=inputs["pixel_values"].to(device, model.dtype),
                         aspect_ratio_ids=inputs["aspect_ratio_ids"].to(device),
                         aspect_ratio_mask=inputs["aspect_ratio_mask"].to(device),
                         cross_attention_mask=mask.to(device),
                         max_new_tokens=new, min_new_tokens=new, do_sample=False)
    return out[:, len(prompts[0]):].tolist()


def mllama_prefix_reuse(model, processor, image: Image.Image, prompts: list[list[int]],
                        new: int) -> list[list[int]]:
    """transformers with its cache reused, one image's questions in one batch
    (``prefix_bench.hf_prefix_reuse``): the image's prefix (its placeholder and the token after
    it) prefilled once with the image, so the vision tower runs once and the cross-attention
    layers' K/V of the image enter the cache."""
    prefix = prompts[0][:len(IMAGE_PREFIX["mllama"])]
    inputs = processor(images=[[image]], return_tensors="pt")
    tiles = [[int(m.sum()) for m in row] for row in inputs["aspect_ratio_mask"]]
    device = model.device
    image_inputs = {"pixel_values": inputs["pixel_values"].to(device, model.dtype),
                    "aspect_ratio_ids": inputs["aspect_ratio_ids"].to(device),
                    "aspect_ratio_mask": inputs["aspect_ratio_mask"].to(device),
                    "cross_attention_mask": _mllama_mask(model, [prefix], tiles).to(device)}
    return hf_prefix_reuse(model, prefix, prompts, new, image_inputs,
                           cross_attention_mask=_mllama_mask(model, prompts, tiles * len(prompts)).to(device))


def _mllama_mask(model, prompts: list[list[int]], tiles: list[list[int]]) -> torch.Tensor:
    sparse = [get_cross_attention_token_mask(p, model.config.image_token_index) for p in prompts]
    return torch.tensor(convert_sparse_cross_attention_mask_to_dense(
        sparse, tiles, model.config.vision_config.max_num_tiles, len(prompts[0])))


@torch.inference_mode()
def qwen_answers(model, processor, images: list[Image.Image], prompts: list[list[int]],
                 new: int) -> list[list[int]]:
    """One batched ``generate``, prompt ``i`` about image ``i`` (images of one size): the image
    pad expanded to the image's tokens, as Qwen's processor does; M-RoPE from
    ``mm_token_type_ids`` and ``image_grid_thw``."""
    inputs = processor(images=list(images), return_tensors="pt")
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
PEERS = {  # family: (save a random model, its transformers class, batched answers, prefix reuse)
    "mllama": (save_random_mllama, MllamaForConditionalGeneration, mllama_answers, mllama_prefix_reuse),
    "qwen2_5_vl": (save_random_qwen2_5_vl, Qwen2_5_VLForConditionalGeneration, qwen_answers, None),
}


def timed_mmkv(model_dir: Path, requests: list[dict], params: SamplingParams, args):
    """Answers, the best of ``args.repeats`` timings (each on a fresh engine) and that engine;
    None for the answers if two runs disagree."""
    best = None
    for _ in range(args.repeats):
        engine = Engine(model_dir, kv_cache_memory="1GiB", host_kv_memory="64MiB",
                        block_size=args.block_size, device=args.device, dtype=args.dtype,
                        attention_backend=args.attention_backend)
        engine.generate([WARM_UP], SamplingParams(max_tokens=2))
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
    save, hf_class, hf_answers, hf_reuse = PEERS[args.family]
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
        hf_answers(model, processor, images[:1], questions[:1], 2)  # warm-up
        every_image = [img for img in images for _ in questions]
        per_image, one_batch, reused = [], [], []
        for _ in range(args.repeats):  # the ways in turn, so a slow stretch meets each
            per_image.append(timed(lambda: [a for img in images for a in hf_answers(
                model, processor, [img] * len(questions), questions, args.a)]))
            one_batch.append(timed(lambda: hf_answers(model, processor, every_image,
                                                      questions * len(images), args.a)))
            if hf_reuse is not None:
                reused.append(timed(lambda: [a for img in images for a in hf_reuse(
                    model, processor, img, questions, args.a)]))
        per_image_s = min(seconds for _, seconds in per_image)
        one_batch_s = min(seconds for _, seconds in one_batch)
    stats = engine.stats()
    result = {
        "family": args.family,
        "speedup_vs_hf_batched": round(min(per_image_s, one_batch_s) / mmkv_s, 2),
        "hf_peer": "per image" if per_image_s <= one_batch_s else "one batch",
        "outputs_equal": ours is not None and all(answers == ours for answers, _ in
                                                  per_image + one_batch + reused),
        "encoder_calls": stats["encoder_calls"],
        "images": args.i,
        "image_size": size,
        "mmkv_seconds": round(mmkv_s, 3),
        "hf_batched_seconds": round(min(per_image_s, one_batch_s), 3),
        "hf_per_image_seconds": round(per_image_s, 3),
        "hf_one_batch_seconds": round(one_batch_s, 3),
        **({"hf_prefix_reuse_seconds": round(min(s for _, s in reused), 3),
            "speedup_vs_hf_prefix_reuse": round(min(s for _, s in reused) / mmkv_s, 2)}
           if reused else {"hf_prefix_reuse": "not measured for this family"}),
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
