"""Cross-attention VLMs: Mllama (Llama 3.2 Vision) and mmkv's own VLM.

Both run a Llama-family text model whose layers at ``cross_attention_layers`` attend to the
projected image features through tanh-gated cross-attention (Mllama's text model). An image's
cross-attention K/V are computed once per layer and kept in blocks of the shared pool; every
question about the image reads the same blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoImageProcessor, MllamaForConditionalGeneration

from mmkv.models.base import (ATTENTION_NAME, ImagePlacement, ModelAdapter, load_hf_config,
                              resolve_dtype)
from mmkv.models.causal_lm import from_pretrained
from mmkv.quantization import Quantization
from mmkv.models.fused_layer import FusedMLP, RMSNorm, fused_linear
from mmkv.step_context import StepContext
from vision import PreparedImage, ProcessorEncoder, VisionPipeline

ATTENTION = {"text_config": ATTENTION_NAME, "vision_config": "sdpa", "": "sdpa"}


@dataclass
class CrossAttentionAdapter(ModelAdapter):
    xattn_tokens_per_tile: int = 0  # image positions per tile (Mllama: patches + class token)
    max_tiles: int = 1

    def placement(self, image: PreparedImage) -> ImagePlacement:
        mask = image.inputs.get("aspect_ratio_mask")
        tiles = int(mask.sum()) if mask is not None else 1
        return ImagePlacement(prompt_tokens=1,
                              xattn_tokens=self.max_tiles * self.xattn_tokens_per_tile,
                              xattn_valid=tiles * self.xattn_tokens_per_tile)

    @torch.inference_mode()
    def xattn_kv(self, embeddings: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        x = embeddings[None].to(self.device, self.dtype)
        n = x.shape[1]
        out = []
        for idx in self.cross_layers:
            attn = self.text_model.layers[idx].cross_attn
            k = attn.k_norm(attn.k_proj(x).view(1, n, attn.num_key_value_heads, attn.head_dim))
            v = attn.v_proj(x).view(n, attn.num_key_value_heads, attn.head_dim)
            out.append((k[0], v))
        return out

    def __post_init__(self) -> None:
        super().__post_init__()
        self.cross_forward = {i: CrossLayerForward(self.text_model.layers[i], self.pack_weights)
                              for i in self.cross_layers}

    def run_cross_layer(self, layer: torch.nn.Module, hidden: torch.Tensor,
                        step: StepContext) -> torch.Tensor:
        """Mllama's cross-attention decoder layer over paged image K/V (identity without images,
        as transformers skips the layer for text-only input)."""
        if step.cross is None:
            return hidden
        return self.cross_forward[layer.layer_idx](hidden[0], step)[None]


class CrossLayerForward:
    """Mllama's cross-attention decoder layer on packed rows ``[T, hidden]``, as its module computes
    it, with its gates' tanh taken once and its MLP's gate and up projections in one GEMM (packed
    for oneDNN on the CPU, as the fused self-attention layers are)."""

    def __init__(self, layer: torch.nn.Module, pack: bool) -> None:
        attn = layer.cross_attn
        self.layer_idx = layer.layer_idx
        self.num_heads, self.head_dim, self.scaling = attn.num_heads, attn.head_dim, attn.scaling
        self.q_proj = fused_linear([attn.q_proj], pack)
        self.o_proj = fused_linear([attn.o_proj], pack)
        self.mlp = FusedMLP(layer.mlp, layer.post_attention_layernorm, pack)
        self.input_norm, self.q_norm = RMSNorm.of(layer.input_layernorm), RMSNorm.of(attn.q_norm)
        self.attn_gate = layer.cross_attn_attn_gate.detach().tanh()
        self.mlp_gate = layer.cross_attn_mlp_gate.detach().tanh()

    def __call__(self, hidden: torch.Tensor, step: StepContext) -> torch.Tensor:
        t = hidden.shape[0]
        q = self.q_norm(self.q_proj(self.input_norm(hidden)).view(t, self.num_heads, self.head_dim))
        o = step.backend.cross_attention(step, q, step.kv_layers[self.layer_idx], self.scaling)
        hidden = hidden + self.attn_gate * self.o_proj(o.reshape(t, -1))
        mlp = step.cross.row_mask[:, None].to(hidden.dtype) * self.mlp(hidden)
        return hidden + self.mlp_gate * mlp


def load_mllama(path: Path, device: torch.device, dtype: str | torch.dtype,
                quantization: Quantization | None = None) -> CrossAttentionAdapter:
    config = load_hf_config(path)
    dtype = resolve_dtype(dtype, config.text_config.dtype or config.dtype, device)
    model = from_pretrained(MllamaForConditionalGeneration, path, dtype, ATTENTION, quantization)
    inner = model.model
    hidden = model.config.text_config.hidden_size

    def features(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        out = inner.vision_model(pixel_values=inputs["pixel_values"].to(device, dtype),
                                 aspect_ratio_ids=inputs["aspect_ratio_ids"].to(device),
                                 aspect_ratio_mask=inputs["aspect_ratio_mask"].to(device))
        return inner.multi_modal_projector(out.last_hidden_state).reshape(-1, hidden)

    encoder = ProcessorEncoder(AutoImageProcessor.from_pretrained(path), features,
                               identity=f"mllama:{Path(path).resolve()}")
    return CrossAttentionAdapter(
        model=model, text_model=inner.language_model, lm_head=model.lm_head,
        text_config=model.config.text_config, device=device, dtype=dtype,
        quantization=quantization,
        cross_layers=tuple(model.config.text_config.cross_attention_layers),
        vision=VisionPipeline(encoder), image_token_id=model.config.image_token_index,
        question_template="<image>{question}",
        xattn_tokens_per_tile=inner.vision_model.num_patches,
        max_tiles=model.config.vision_config.max_num_tiles)
