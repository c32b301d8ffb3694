"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL: a ViT whose merged patch features replace the image pad
tokens of a Qwen text model that places tokens with multimodal rotary positions (M-RoPE).

An image is ``<|vision_start|>``, ``t·h·w / merge²`` × ``<|image_pad|>``, ``<|vision_end|>``;
its grid ``(t, h, w)`` comes from the image processor (each side resized to a multiple of patch ×
merge within its min/max pixels). The pad tokens enter the radix tree tagged with the image's
identity (pixels and grid) and their offset, so the same image at the same place shares its K/V.

Positions come from the model's own ``get_rope_index`` over the whole prompt at submission
(``mrope.MRopePositions``); rotary cos/sin are read per axis from the module's table, each
frequency from the axis the module's own recomposition assigns it (contiguous T/H/W sections for
Qwen2/2.5-VL, interleaved for Qwen3-VL). Qwen3-VL's deepstack adds features of some vision layers
to the image rows after the first text layers: the encoder output of an image is its merged
features followed by each deepstack layer's, side by side (``[tokens, (1 + deepstack) × hidden]``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (AutoImageProcessor, Qwen2_5_VLForConditionalGeneration,
                          Qwen2VLForConditionalGeneration, Qwen3VLForConditionalGeneration)

from mmkv.models.base import (ATTENTION_NAME, ImagePlacement, ModelAdapter, load_hf_config,
                              resolve_dtype)
from mmkv.models.causal_lm import from_pretrained
from mmkv.quantization import Quantization
from mmkv.models.mrope import MRopePositions
from mmkv.step_context import StepContext
from vision import PreparedImage, ProcessorEncoder, VisionPipeline

QWEN_VL_FAMILIES = {"qwen2_vl": Qwen2VLForConditionalGeneration,
                    "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
                    "qwen3_vl": Qwen3VLForConditionalGeneration}
ATTENTION = {"text_config": ATTENTION_NAME, "vision_config": "sdpa", "": "sdpa"}
IMAGE_MARKUP = "<|vision_start|><|image_pad|><|vision_end|>"


@dataclass
class QwenVLAdapter(ModelAdapter):
    """Guarantees, besides ``ModelAdapter``'s: every token is rotated at the position the model's
    own ``get_rope_index`` gives it for the whole prompt (generated tokens: index + the prompt's
    delta), and image rows carry the image's features (and deepstack features) wherever a step's
    chunk boundaries fall."""

    merge_size: int = 2
    deepstack_layers: int = 0  # Qwen3-VL: text layers after which deepstack features are added

    def __post_init__(self) -> None:
        super().__post_init__()
        module = self.text_model.rotary_emb
        half = module.inv_freq.shape[0]
        probe = torch.arange(3, dtype=torch.float32).view(3, 1, 1, 1).expand(3, 1, 1, half).clone()
        # which of (T, H, W) each rotary column reads, as the module itself recomposes them
        self.axis_of_column = module.recomposition_frequencies(probe)[0, 0].long().to(self.device)

    def placement(self, image: PreparedImage) -> ImagePlacement:
        t, h, w = image.inputs["image_grid_thw"][0].tolist()
        return ImagePlacement(prompt_tokens=t * h * w // self.merge_size ** 2)

    def prompt_positions(self, token_ids: list[int], images: list[Any]) -> MRopePositions:
        if not images:
            return MRopePositions.text()
        types = torch.zeros(1, len(token_ids), dtype=torch.int32)
        for previous, image in zip([None, *images], images):
            if previous is not None and previous.start + previous.placement.prompt_tokens == image.start:
                raise ValueError("two images are adjacent in the prompt; separate them with at "
                                 f"least one text token such as {IMAGE_MARKUP!r} writes")
            types[0, image.start:image.start + image.placement.prompt_tokens] = 1
        grids = torch.cat([i.image.inputs["image_grid_thw"] for i in images])
        positions, delta = self.model.model.get_rope_index(
            torch.tensor([token_ids]), mm_token_type_ids=types, image_grid_thw=grids)
        end = images[-1].start + images[-1].placement.prompt_tokens
        return MRopePositions(positions[:, 0, :end].numpy().copy(), int(delta))

    def rotary(self, hidden: torch.Tensor, positions: torch.Tensor,
               longest: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at (T, H, W) ``positions`` ``[3, T]`` (``[1, T]``: the same on every
        axis), all below ``longest``: column ``j`` of a token is the table's at that token's
        position on the axis of column ``j``."""
        if positions.shape[0] == 1:
            return super().rotary(hidden, positions, longest)
        table = self.rotary_table(hidden, longest)
        if table is None:
            return self.text_model.rotary_emb(hidden, position_ids=positions[:, None])
        index = positions.index_select(0, self.axis_of_column).T
        return table[0].gather(0, index)[None], table[1].gather(0, index)[None]

    def after_layer(self, i: int, hidden: torch.Tensor, step: StepContext) -> torch.Tensor:
        """After each of the first ``deepstack_layers`` layers the image rows get that layer's
        deepstack features added, as Qwen3-VL's text model does."""
        if step.image_rows is None or i >= self.deepstack_layers:
            return hidden
        width = hidden.shape[-1]
        features = step.image_embeds[:, width * (i + 1):width * (i + 2)].to(hidden.dtype)
        hidden[0, step.image_rows] = hidden[0, step.image_rows] + features
        return hidden


def load_qwen_vl(path: Path, family: str, device: torch.device, dtype: str | torch.dtype,
                 quantization: Quantization | None = None) -> QwenVLAdapter:
    config = load_hf_config(path)
    dtype = resolve_dtype(dtype, config.text_config.dtype or config.dtype, device)
    model = from_pretrained(QWEN_VL_FAMILIES[family], path, dtype, ATTENTION, quantization)
    inner = model.model

    def features(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        out = inner.get_image_features(pixel_values=inputs["pixel_values"].to(device, dtype),
                                       image_grid_thw=inputs["image_grid_thw"].to(device))
        deepstack = getattr(out, "deepstack_features", None) or []
        return torch.cat([out.pooler_output[0], *(layer[0] for layer in deepstack)], dim=-1)

    encoder = ProcessorEncoder(AutoImageProcessor.from_pretrained(path), features,
                               identity=f"{family}:{Path(path).resolve()}")
    vision = model.config.vision_config
    return QwenVLAdapter(
        model=model, text_model=inner.language_model, lm_head=model.lm_head,
        text_config=model.config.text_config, device=device, dtype=dtype,
        quantization=quantization,
        vision=VisionPipeline(encoder), image_token_id=model.config.image_token_id,
        image_markup=IMAGE_MARKUP, chat_questions=True, merge_size=vision.spatial_merge_size,
        deepstack_layers=len(getattr(vision, "deepstack_visual_indexes", None) or ()))
