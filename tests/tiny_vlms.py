"""Tiny random vision-language checkpoints (Mllama, LLaVA, mmkv_vlm) and their oracles."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                          LlavaForConditionalGeneration, MllamaConfig,
                          MllamaForConditionalGeneration, MllamaImageProcessor, PreTrainedTokenizerFast)
from transformers.models.mllama.modeling_mllama import _prepare_cross_attention_mask
from transformers.models.mllama.processing_mllama import (
    convert_sparse_cross_attention_mask_to_dense, get_cross_attention_token_mask)
from transformers.utils import logging as hf_logging

from mmkv.models import MmkvVLM

IMAGE_TOKEN = 256
TEXT = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, initializer_range=0.15)


def picture(seed: int, size=(40, 30)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")


def save_tokenizer(directory: Path, image_token: str) -> None:
    """Characters 0..255 are their own ids; the image token is id 256."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab={chr(i): i for i in range(256)}, unk_token=chr(0)))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_special_tokens({"additional_special_tokens": [image_token]})
    assert fast.convert_tokens_to_ids(image_token) == IMAGE_TOKEN
    fast.save_pretrained(directory)


def _open_gates(language_model: torch.nn.Module) -> None:
    """Cross-attention gates start at 0 (images ignored); open them so images matter, the attention
    and MLP gates to different values so that swapping them shows."""
    with torch.no_grad():
        for name, p in language_model.named_parameters():
            if name.endswith("_gate"):
                p.fill_(0.6 if name.endswith("mlp_gate") else 0.9)


def build_mllama(directory: Path, seed: int = 0, **text_overrides) -> Path:
    hf_logging.disable_progress_bar()
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=1,
                  attention_heads=2, image_size=28, patch_size=14, max_num_tiles=2,
                  intermediate_layers_indices=[0], vision_output_dim=64,
                  supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]], initializer_range=0.15)
    text = dict(TEXT, num_hidden_layers=4, cross_attention_layers=[1, 3], vocab_size=256,
                pad_token_id=3, bos_token_id=1, eos_token_id=2, **text_overrides)
    config = MllamaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN)
    torch.manual_seed(seed)
    model = MllamaForConditionalGeneration(config)
    _open_gates(model.model.language_model)
    model.save_pretrained(directory)
    MllamaImageProcessor(size={"height": 28, "width": 28}, max_image_tiles=2).save_pretrained(directory)
    save_tokenizer(directory, "<|image|>")
    return directory


def build_llava(directory: Path, seed: int = 0) -> Path:
    hf_logging.disable_progress_bar()
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, image_size=28, patch_size=14,
                              initializer_range=0.15)
    text = LlamaConfig(**TEXT, num_hidden_layers=2, vocab_size=260, bos_token_id=None,
                       eos_token_id=None, pad_token_id=None)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN)
    torch.manual_seed(seed)
    LlavaForConditionalGeneration(config).save_pretrained(directory)
    CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}).save_pretrained(directory)
    save_tokenizer(directory, "<image>")
    return directory


def build_mmkv_vlm(directory: Path, seed: int = 0, vision_width: int = 32, vision_layers: int = 2,
                   **text) -> Path:
    """``text`` overrides entries of the text model's config (and may add ``early_exit_layer``)."""
    early_exit = text.pop("early_exit_layer", None)
    config = {
        "vision": {"open_clip_vision_cfg": {"image_size": 32, "layers": vision_layers,
                                            "width": vision_width, "patch_size": 8, "head_width": 16},
                   "embed_dim": 32, "image_size": 32,
                   "patch_name_ids": [[10 + p, 30 + p // 4] for p in range(16)], "patch_name_scale": 2.0},
        "text_config": {**TEXT, "num_hidden_layers": 4, "cross_attention_layers": [1, 3],
                        "vocab_size": 256, "pad_token_id": 3, "bos_token_id": 1, "eos_token_id": 2,
                        **text},
        "image_token_id": IMAGE_TOKEN,
        "question_template": "<image>Q:{question}\nA:",
        **({"early_exit_layer": early_exit} if early_exit is not None else {}),
    }
    torch.manual_seed(seed)
    model = MmkvVLM(config)
    _open_gates(model.language_model)
    model.save_pretrained(directory)
    save_tokenizer(directory, "<image>")
    return directory


@torch.inference_mode()
def mllama_greedy(model, processor, prompt: list[int], images: list[Image.Image], new: int) -> list[int]:
    """transformers' generate on Mllama with the processor's cross-attention mask."""
    kwargs = {}
    if images:
        inputs = processor(images=[images], return_tensors="pt")
        tiles = [[int(m.sum()) for m in inputs["aspect_ratio_mask"][0]]]
        sparse = [get_cross_attention_token_mask(prompt, IMAGE_TOKEN)]
        kwargs = dict(pixel_values=inputs["pixel_values"], aspect_ratio_ids=inputs["aspect_ratio_ids"],
                      aspect_ratio_mask=inputs["aspect_ratio_mask"],
                      cross_attention_mask=torch.tensor(convert_sparse_cross_attention_mask_to_dense(
                          sparse, tiles, model.config.vision_config.max_num_tiles, len(prompt))))
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, **kwargs)
    return out[0, len(prompt):].tolist()


@torch.inference_mode()
def llava_greedy(model, processor, prompt: list[int], image: Image.Image, new: int,
                 tokens_per_image: int) -> list[int]:
    """transformers' generate on LLaVA with the placeholder expanded like its processor does."""
    ids = []
    for t in prompt:
        ids.extend([t] * (tokens_per_image if t == IMAGE_TOKEN else 1))
    pixels = processor(images=[image], return_tensors="pt")["pixel_values"]
    out = model.generate(torch.tensor([ids]), pixel_values=pixels, max_new_tokens=new,
                         min_new_tokens=new, do_sample=False)
    return out[0, len(ids):].tolist()


@torch.inference_mode()
def mmkv_vlm_plain_greedy(model: MmkvVLM, pixels: torch.Tensor, prompt: list[int], new: int) -> list[int]:
    """No cache at all: the whole sequence through the modules at every step, with Mllama's
    cross-attention mask (one tile, seen from the image placeholder on)."""
    states = model.image_features(pixels)
    ids = list(prompt)
    for _ in range(new):
        ids.append(int(mmkv_vlm_logits(model, states, ids)[-1].argmax()))
    return ids[len(prompt):]


@torch.inference_mode()
def mmkv_vlm_logits(model: MmkvVLM, states: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """Logits ``[len(ids), vocab]`` of the whole sequence, the image (projected patch tokens
    ``states``, ``[1, patches, hidden]``) seen from its placeholder on."""
    dense = torch.zeros(1, len(ids), 1, 1)
    dense[0, ids.index(IMAGE_TOKEN):] = 1
    mask, rows = _prepare_cross_attention_mask(dense, num_vision_tokens=states.shape[1],
                                               dtype=states.dtype)
    device = states.device
    return model.language_model(input_ids=torch.tensor([ids], device=device),
                                cross_attention_states=states, cross_attention_mask=mask.to(device),
                                full_text_row_masked_out_mask=rows.to(device), use_cache=False).logits[0]
