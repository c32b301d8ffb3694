"""Many questions about few images: mmkv against transformers' batched generate per image.

A random Mllama (vision tower hidden 256, 4 local + 2 global layers, 224-pixel tiles, patch 14;
text model the prefix benchmark's Llama with cross-attention at layers 3 and 7) answers ``--q``
questions about each of ``--i`` images, ``--a`` greedy tokens each. mmkv gets every request in one
``generate`` call (cold cache); transformers gets one batched ``generate`` per image (the image
repeated for each question, as its API needs). Outputs must be equal. ``--device cuda`` runs both
sides on the GPU (in ``--dtype``, mmkv on ``--attention-backend``).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import AutoImageProcessor, MllamaForConditionalGeneration
from transformers.models.mllama.processing_mllama import (
    convert_sparse_cross_attention_mask_to_dense, get_cross_attention_token_mask)

from mmkv import Engine, SamplingParams
from mmkv.bench import timed
from mmkv.bench.prefix_bench import add_device_arguments
from mmkv.bench.random_models import BENCH_LLAMA, save_random_mllama, text_size


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--i", type=int, default=4, help="images")
    p.add_argument("--q", type=int, default=16, help="questions per image")
    p.add_argument("--a", type=int, default=16, help="answer tokens")
    p.add_argument("--question-tokens", type=int, default=12)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--hidden-size", type=int, default=BENCH_LLAMA["hidden_size"],
                   help="text model width (the figures in the README use the default)")
    p.add_argument("--num-layers", type=int, default=BENCH_LLAMA["num_hidden_layers"])
    p.add_argument("--seed", type=int, default=0)
    add_device_arguments(p)


@torch.inference_mode()
def hf_answers(model, processor, image: Image.Image, prompts: list[list[int]], new: int) -> list[list[int]]:
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


def run(args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(args.seed)
    images = [Image.fromarray(rng.integers(0, 256, (224, 224, 3), dtype=np.uint8), "RGB")
              for _ in range(args.i)]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_random_mllama(Path(tmp) / "mllama", seed=args.seed,
                                       **text_size(args.hidden_size, args.num_layers))
        engine = Engine(model_dir, kv_cache_memory="1GiB", host_kv_memory="64MiB",
                        block_size=args.block_size, device=args.device, dtype=args.dtype,
                        attention_backend=args.attention_backend)
        image_token = engine.model.image_token_id
        questions = [[image_token, 1] + rng.integers(4, 8000, size=args.question_tokens).tolist()
                     for _ in range(args.q)]
        params = SamplingParams(max_tokens=args.a, ignore_eos=True)
        engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2))  # warm-up, text only
        requests = [{"prompt": q, "images": [img]} for img in images for q in questions]
        ours, mmkv_s = timed(lambda: [o.token_ids for o in engine.generate(requests, params)])

        model = MllamaForConditionalGeneration.from_pretrained(
            model_dir, dtype=getattr(torch, args.dtype)).to(args.device).eval()
        processor = AutoImageProcessor.from_pretrained(model_dir)
        hf_answers(model, processor, images[0], questions[:1], 2)  # warm-up
        theirs, hf_s = timed(lambda: [a for img in images
                                      for a in hf_answers(model, processor, img, questions, args.a)])
    stats = engine.stats()
    bytes_per_block = engine.kv.bytes_per_block
    tokens = engine.model.max_tiles * engine.model.xattn_tokens_per_tile
    per_image_blocks = -(-tokens // args.block_size)
    return {
        "speedup_vs_hf_batched": round(hf_s / mmkv_s, 2),
        "outputs_equal": ours == theirs,
        "encoder_calls": stats["encoder_calls"],
        "images": args.i,
        "xattn_kv_bytes": stats["xattn_blocks_computed"] * bytes_per_block,
        "xattn_kv_bytes_unique_bound": args.i * per_image_blocks * bytes_per_block,
        "mmkv_seconds": round(mmkv_s, 3),
        "hf_batched_seconds": round(hf_s, 3),
        "questions_per_image": args.q,
        "answer_tokens": args.a,
        "device": args.device, "dtype": args.dtype, "attention_backend": engine.attention.name,
    }
