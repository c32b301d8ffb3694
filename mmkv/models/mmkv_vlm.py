"""mmkv's own cross-attention VLM (Flamingo style).

An open_clip vision tower gives patch tokens, a linear projector maps them to the text width, and a
Llama-family text model with tanh-gated cross-attention layers at ``cross_attention_layers``
(transformers' Mllama text model) reads them. A model directory holds::

    config.json        {"model_type": "mmkv_vlm", "vision": {...}, "text_config": {...},
                        "image_token_id": N, "question_template": "<image>{question}"}
    model.safetensors  vision_tower.*, projector.*, language_model.*
    tokenizer files    (the image token is a special token of the tokenizer)

``vision`` names an open_clip architecture (``{"open_clip_arch": "ViT-B-32"}``) or gives its
vision config (``{"open_clip_vision_cfg": {...}, "embed_dim": 64}``); ``image_size`` is the
input resolution; ``patch_name_ids`` (one list of token ids per patch, e.g. the tokens of "top
left") tags each projected patch with ``patch_name_scale`` times the sum of the text model's own
embeddings of those tokens, so a question that names a place can find its patch by matching the
same token embeddings (cross-attention keys carry no rotary position); ``open_clip_weights`` optionally starts a new model's tower from a local open_clip
checkpoint (a saved model's own weights file takes precedence when it is loaded).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import MllamaForCausalLM, MllamaTextConfig
from transformers.models.mllama.modeling_mllama import _prepare_cross_attention_mask

from mmkv.models.base import ModelLoadError, resolve_dtype
from mmkv.models.cross_attention import CrossAttentionAdapter
from mmkv.quantization import Quantization
from mmkv.quantization.loading import quantize_loaded
from vision import OpenClipEncoder, VisionPipeline, open_clip_vision_tower

MODEL_TYPE = "mmkv_vlm"
WEIGHTS = "model.safetensors"


class MmkvVLM(torch.nn.Module):
    """Vision tower + projector + cross-attention language model, built from a config dict."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self.config = config
        vision = config["vision"]
        self.vision_tower = open_clip_vision_tower(vision.get("open_clip_arch"),
                                                   vision.get("open_clip_vision_cfg"),
                                                   vision.get("embed_dim", 512),
                                                   vision.get("open_clip_weights"))
        text_config = MllamaTextConfig(**config["text_config"])
        self.projector = torch.nn.Linear(self.vision_tower.conv1.out_channels, text_config.hidden_size)
        self.language_model = MllamaForCausalLM(text_config)
        names = vision.get("patch_name_ids")
        self.patch_name_ids = [torch.tensor(ids, dtype=torch.long) for ids in names] if names else None
        if names:
            scale = float(vision.get("patch_name_scale", 1.0))
            self.patch_name_scale = torch.nn.Parameter(torch.tensor(scale))

    @property
    def image_size(self) -> int:
        return int(self.config["vision"]["image_size"])

    def project(self, tokens: torch.Tensor) -> torch.Tensor:
        """Tower patch tokens to text width, tagged with their patch names when configured."""
        out = self.projector(tokens)
        if self.patch_name_ids is None:
            return out
        embed = self.language_model.model.embed_tokens
        names = torch.stack([embed(ids.to(out.device)).sum(0) for ids in self.patch_name_ids])
        return out + self.patch_name_scale * names

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Projected patch tokens ``[batch, patches, text_hidden]``."""
        _, tokens = self.vision_tower(pixel_values)
        return self.project(tokens)

    @staticmethod
    def image_inputs(states: torch.Tensor, length: int) -> dict[str, torch.Tensor]:
        """Keyword arguments that let every one of ``length`` text positions of each sequence read
        its image's ``states`` (``[batch, patches, hidden]``) in the cross-attention layers; for
        whole-sequence forwards outside the engine (training, inspection)."""
        dense = torch.ones(states.shape[0], length, 1, 1)
        mask, rows = _prepare_cross_attention_mask(dense, num_vision_tokens=states.shape[1],
                                                   dtype=states.dtype)
        return {"cross_attention_states": states, "cross_attention_mask": mask,
                "full_text_row_masked_out_mask": rows}

    def save_pretrained(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(json.dumps({**self.config, "model_type": MODEL_TYPE},
                                                          indent=2))
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        save_file(state, directory / WEIGHTS)

    @classmethod
    def from_pretrained(cls, directory: str | Path, dtype: torch.dtype = torch.float32) -> "MmkvVLM":
        directory = Path(directory)
        config = json.loads((directory / "config.json").read_text())
        try:
            model = cls(config)
            state = load_file(directory / WEIGHTS)
            missing, unexpected = model.load_state_dict(state, strict=False)
        except (OSError, KeyError, TypeError, ValueError, RuntimeError) as err:
            raise ModelLoadError(f"cannot load mmkv_vlm from {str(directory)!r}: {err}") from err
        tied = {"language_model.lm_head.weight"} if config["text_config"].get("tie_word_embeddings") else set()
        if set(missing) - tied or unexpected:
            raise ModelLoadError(f"{directory / WEIGHTS} does not match its config: missing "
                                 f"{sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]}")
        if tied:
            model.language_model.tie_weights()
        return model.to(dtype).eval()


def load_mmkv_vlm(path: Path, raw_config: dict[str, Any], device: torch.device,
                  dtype: str | torch.dtype, quantization: Quantization | None = None) -> CrossAttentionAdapter:
    dtype = resolve_dtype(dtype, raw_config["text_config"].get("dtype"), device)
    model = MmkvVLM.from_pretrained(path, dtype)
    if quantization is not None:  # after loading: the file is read whole (a small model's)
        quantize_loaded(model, quantization)
    lm = model.language_model
    lm.config._attn_implementation = "mmkv_paged"
    encoder = OpenClipEncoder(model.vision_tower, model.project, model.image_size,
                              identity=f"mmkv_vlm:{Path(path).resolve()}")
    patches = (model.image_size // model.vision_tower.conv1.stride[0]) ** 2
    return CrossAttentionAdapter(
        model=model, text_model=lm.model, lm_head=lm.lm_head, text_config=lm.config,
        device=device, dtype=dtype, cross_layers=tuple(lm.config.cross_attention_layers),
        vision=VisionPipeline(encoder), image_token_id=int(raw_config["image_token_id"]),
        question_template=raw_config.get("question_template", "<image>{question}"),
        early_exit_layer=raw_config.get("early_exit_layer"), quantization=quantization,
        xattn_tokens_per_tile=patches, max_tiles=1)
