"""LLaVA: a CLIP vision tower whose projected patch features replace the image placeholder
tokens of a Llama-family language model (image tokens in the sequence)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoImageProcessor, LlavaForConditionalGeneration

from mmkv.models.base import (ATTENTION_NAME, ImagePlacement, ModelAdapter, load_hf_config,
                              resolve_dtype)
from mmkv.models.causal_lm import from_pretrained
from mmkv.quantization import Quantization
from vision import PreparedImage, ProcessorEncoder, VisionPipeline

ATTENTION = {"text_config": ATTENTION_NAME, "vision_config": "sdpa", "": "sdpa"}


@dataclass
class LlavaAdapter(ModelAdapter):
    tokens_per_image: int = 0  # projected patch features per image

    def placement(self, image: PreparedImage) -> ImagePlacement:
        return ImagePlacement(prompt_tokens=self.tokens_per_image)


def load_llava(path: Path, device: torch.device, dtype: str | torch.dtype,
               quantization: Quantization | None = None) -> LlavaAdapter:
    config = load_hf_config(path)
    dtype = resolve_dtype(dtype, config.text_config.dtype or config.dtype, device)
    model = from_pretrained(LlavaForConditionalGeneration, path, dtype, ATTENTION, quantization)
    vc = model.config.vision_config
    strategy = model.config.vision_feature_select_strategy
    patches = (vc.image_size // vc.patch_size) ** 2

    def features(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        pixels = inputs["pixel_values"].to(device, dtype)
        out = model.model.get_image_features(
            pixel_values=pixels, vision_feature_layer=model.config.vision_feature_layer,
            vision_feature_select_strategy=strategy)
        return out.pooler_output[0]

    encoder = ProcessorEncoder(AutoImageProcessor.from_pretrained(path), features,
                               identity=f"llava:{Path(path).resolve()}")
    return LlavaAdapter(model=model, text_model=model.model.language_model,
                        lm_head=model.lm_head, text_config=model.config.text_config,
                        device=device, dtype=dtype, vision=VisionPipeline(encoder), quantization=quantization,
                        image_token_id=model.config.image_token_index,
                        tokens_per_image=patches + (strategy == "full"))
