"""What every model family shares: loading checks, the attention hook, the layer loop.

mmkv drives transformers' own modules (embeddings, decoder layers, norms, rotary embedding, LM
head), so every operation but attention is the checkpoint's reference implementation; attention is
mmkv's, plugged in through transformers' ``AttentionInterface``. A step runs all scheduled tokens
of all sequences as one packed row (``[1, total_tokens]``) with explicit positions; the paged
metadata tells attention where each sequence's KV lives.

KV storage has one *slot* per self-attention layer; cross-attention layers (image K/V) reuse the
first slots, since a block holds either text K/V or image K/V, never both.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from transformers import AttentionInterface, AutoConfig, PretrainedConfig

from cache import KVLayout
from cache.kv_format import check_head_dim, storage_dtype
from mmkv.heap import release_free_heap
from mmkv.models.fused_layer import FusedDecoderLayer, norm_function, rotation_signs
from mmkv.models.packed_linear import PackedLinear, PlainLinear, make_linear, release
from mmkv.quantization import Quantization, QuantizedLinear, QuantizedLinearModule
from mmkv.quantization.formats import quantize_int8
from mmkv.models.mrope import MRopePositions
from mmkv.step_context import StepContext
from vision import PreparedImage, VisionPipeline

ATTENTION_NAME = "mmkv_paged"


class ModelLoadError(ValueError):
    """The model directory is missing, incomplete, corrupt or of an unsupported family."""


def _paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: torch.Tensor | None,
                     scaling: float | None = None, sliding_window: int | None = None,
                     mmkv_step: StepContext | None = None, **_: object):
    """transformers attention hook: write this step's K/V into the pages, attend over the pages
    (with the engine's attention backend)."""
    if mmkv_step is None:
        raise RuntimeError("mmkv's paged attention runs only inside an mmkv engine step")
    layer = mmkv_step.kv_layers[module.layer_idx]
    backend = mmkv_step.backend
    q = query[0].transpose(0, 1)  # [T, heads, head_dim]
    backend.write_kv(mmkv_step, layer, key[0].transpose(0, 1), value[0].transpose(0, 1))
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = backend.attention(mmkv_step, q, layer, scale, sliding_window)
    return out[None], None


AttentionInterface.register(ATTENTION_NAME, _paged_attention)


def read_config_json(path: str | Path) -> dict[str, Any]:
    """The raw config.json of a model directory, or ``ModelLoadError`` saying what is wrong."""
    root = Path(path)
    if not root.is_dir():
        raise ModelLoadError(f"model directory {str(path)!r} does not exist")
    config_file = root / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"model directory {str(path)!r} has no config.json")
    try:
        raw = json.loads(config_file.read_text())
    except ValueError as err:
        raise ModelLoadError(f"{config_file} is not a valid model config: {err}") from err
    if not isinstance(raw, dict) or not isinstance(raw.get("model_type"), str):
        raise ModelLoadError(f"{config_file} is not a valid model config: no model_type")
    return raw


def load_hf_config(path: str | Path) -> PretrainedConfig:
    try:
        return AutoConfig.from_pretrained(Path(path))
    except (ValueError, KeyError, TypeError) as err:
        raise ModelLoadError(f"{Path(path) / 'config.json'} is not a valid model config: {err}") from err


def parameter_count(module: torch.nn.Module) -> int:
    """The weights a module computes with (a quantized layer's ``in x out``, not its codes)."""
    quantized = [m for m in module.modules() if isinstance(m, QuantizedLinearModule)]
    codes = {id(m.weight) for m in quantized}
    return (sum(p.numel() for p in module.parameters() if id(p) not in codes)
            + sum(m.in_features * m.out_features for m in quantized))


def tensor_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers, each storage counted once (quantized layers
    at their codes, scales and offsets)."""
    storages = {}
    for t in (*module.parameters(), *module.buffers()):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, stored: Any, device: torch.device) -> torch.dtype:
    """``auto``: fp32 on CPU, the checkpoint's dtype (``stored``) on GPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        return getattr(torch, stored) if isinstance(stored, str) else (stored or torch.float32)
    if not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise ValueError(f"dtype must be 'auto' or a torch dtype name such as 'float32', got {dtype!r}")
    return getattr(torch, dtype)


@dataclass(slots=True)
class ImagePlacement:
    """How a model places an image in a prompt."""

    prompt_tokens: int  # tokens the image occupies in the sequence (LLaVA: its patches; else 1)
    xattn_tokens: int = 0  # cross-attention K/V positions (0: no cross-attention)
    xattn_valid: int = 0  # of those, the ones a text token may attend to (Mllama: real tiles)


@dataclass
class ModelAdapter:
    """One loaded model family: its modules, how its KV is laid out and how a step runs.

    Guarantees: ``forward`` returns the logits transformers would compute for the same tokens at
    the same positions with the same preceding context (and images).
    """

    model: torch.nn.Module
    text_model: torch.nn.Module  # has embed_tokens, layers, norm, rotary_emb
    lm_head: torch.nn.Module
    text_config: PretrainedConfig
    device: torch.device
    dtype: torch.dtype
    cross_layers: tuple[int, ...] = ()
    vision: VisionPipeline | None = None
    image_token_id: int | None = None
    question_template: str = "<image>{question}"
    image_markup: str | None = None  # the text "<image>" stands for (default: the image token)
    chat_questions: bool = False  # ask() puts each question in the model's chat template
    early_exit_layer: int | None = None  # layers trained to draft through the final head
    quantization: Quantization | None = None  # how the linear layers were quantized at load
    weights_format: str | None = None  # how a checkpoint quantized elsewhere stores them ("gguf Q4_K_M",
    # "awq int4 (group 128)"; a Hugging Face loader leaves it on the model as mmkv_weights_format)

    def __post_init__(self) -> None:
        self.weights_format = self.weights_format or getattr(self.model, "mmkv_weights_format", None)
        self.model.to(self.device).eval()
        self.weight_bytes = tensor_bytes(self.model)
        c = self.text_config
        self.num_layers = c.num_hidden_layers
        self.sliding_window: int | None = getattr(c, "sliding_window", None)
        self.max_model_len: int = c.max_position_embeddings
        self.vocab_size: int = c.vocab_size
        self.num_parameters = parameter_count(self.model)
        self._layer_parameters = parameter_count(self.text_model.layers)
        self._vision_parameters = self.num_parameters - parameter_count(self.text_model) - (
            0 if self.lm_head.weight is self.text_model.embed_tokens.weight
            else parameter_count(self.lm_head))
        self_layers = [i for i in range(self.num_layers) if i not in self.cross_layers]
        slots = {layer: slot for slot, layer in enumerate(self_layers)}
        slots.update({layer: j for j, layer in enumerate(self.cross_layers)})
        self.layer_slots = [slots[i] for i in range(self.num_layers)]
        self.num_slots = max(len(self_layers), len(self.cross_layers))
        # mmkv's own forward where the layer has the Llama structure; transformers' module otherwise.
        # On the CPU their GEMMs and the head's run on weights packed once for oneDNN.
        self.pack_weights = self.device.type == "cpu" and os.environ.get("MMKV_PACK_WEIGHTS", "1") != "0"
        self.fused = {}
        for i in self_layers:
            if FusedDecoderLayer.supports(self.text_model.layers[i]):
                self.fused[i] = FusedDecoderLayer(self.text_model.layers[i], self.pack_weights)
                release_free_heap()  # the layer's unfused weights, freed mid-heap
        self.head = self.make_head()
        release_free_heap()
        self._rotary_table: tuple[torch.Tensor, torch.Tensor] | None = None
        # (the rotary table it was made from, cos and signed sine [positions, 2, head_dim])
        self._rotation_table: tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        self.final_norm = norm_function(self.text_model.norm)
        embedding = self.text_model.embed_tokens  # a lookup without the module call, where it is one
        self._embedding = embedding if type(embedding) is torch.nn.Embedding and embedding.max_norm is None else None

    def make_head(self) -> PackedLinear | PlainLinear | QuantizedLinear:
        """The LM head as it runs: quantized as the checkpoint quantized it, or to int8 when
        ``quantization.lm_head`` asks (the module's own weight released unless the embeddings
        share it), else packed or plain."""
        head = self.lm_head
        if isinstance(head, QuantizedLinearModule):  # a checkpoint's quantized head, as it came
            return head.linear
        tied = head.weight is self.text_model.embed_tokens.weight
        if self.quantization is not None and self.quantization.lm_head:
            linear = QuantizedLinear(quantize_int8(head.weight), head.bias)
            self.weight_bytes += linear.nbytes - (0 if tied else head.weight.nbytes)
        else:
            linear = make_linear(head.weight, head.bias, self.pack_weights)
            if not isinstance(linear, PackedLinear):
                return linear
        if not tied:
            release(head)
        return linear

    # -- layout ---------------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        c = self.text_config
        return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads

    def kv_layout(self, block_size: int, kv_cache_dtype: str = "auto",
                  full_precision_layers: Sequence[int] = ()) -> KVLayout:
        """The cache layout of this model: every storage slot in ``kv_cache_dtype``'s format
        (``cache.kv_format``) but those of the decoder layers ``full_precision_layers``, which
        stay in the model's dtype (a slot several layers use is kept if any of them is listed).
        ``ValueError`` names a layer the model does not have or a format it cannot store."""
        stored = storage_dtype(kv_cache_dtype, self.dtype)
        check_head_dim(stored, self.head_dim)
        outside = [i for i in full_precision_layers if not 0 <= i < self.num_layers]
        if outside:
            raise ValueError(f"kv_cache_dtype_layers names layer {outside[0]}; the model has layers "
                             f"0 to {self.num_layers - 1}")
        kept = {self.layer_slots[i] for i in full_precision_layers}
        dtypes = tuple(self.dtype if s in kept else stored for s in range(self.num_slots))
        return KVLayout(num_layers=self.num_slots, num_kv_heads=self.text_config.num_key_value_heads,
                        head_dim=self.head_dim, block_size=block_size, dtype=self.dtype,
                        layer_dtypes=dtypes)

    # -- rebuild costs: what evicting or dropping cached K/V costs to compute again -------------
    def text_rebuild_flops(self, start: int, count: int) -> float:
        """FLOPs to recompute the K/V of ``count`` tokens at positions ``start, start + 1, ...``:
        every decoder layer's weights once per token, and each token's attention over the
        positions up to its own."""
        c = self.text_config
        pairs = count * start + count * (count + 1) / 2
        return (2 * self._layer_parameters * count
                + 4 * self.num_layers * c.num_attention_heads * self.head_dim * pairs)

    def image_rebuild_flops(self, placement: ImagePlacement) -> float:
        """FLOPs to compute an image's cross-attention K/V again from its pixels: the vision
        tower and projector once per image token, then every cross-attention layer's K and V
        projections."""
        tokens = placement.xattn_tokens or placement.prompt_tokens
        kv_width = self.text_config.num_key_value_heads * self.head_dim
        projections = 2 * 2 * self.text_config.hidden_size * kv_width * len(self.cross_layers)
        return tokens * (2 * self._vision_parameters + projections)

    def layer_views(self, storage_layers: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each model layer's KV tensor."""
        return [storage_layers[s] for s in self.layer_slots]

    def cascade_allowed(self, max_kv_len: int) -> bool:
        """Shared-prefix attention is exact only when no sliding window cuts into a sequence."""
        return self.sliding_window is None or max_kv_len <= self.sliding_window

    # -- images ---------------------------------------------------------------------------------
    def placement(self, image: PreparedImage) -> ImagePlacement:
        raise ValueError("this model does not take images")

    def prompt_positions(self, token_ids: list[int], images: list[Any]) -> MRopePositions | None:
        """M-RoPE positions of a whole prompt whose images (``SeqImage``) are placed; None for
        models whose positions are the token indices. Raises ``ValueError`` for a prompt the
        model cannot position."""
        return None

    def xattn_kv(self, embeddings: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per cross-attention layer, K and V ``[tokens, kv_heads, head_dim]`` of an image."""
        raise ValueError("this model has no cross-attention")

    # -- the step -------------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor, step: StepContext) -> torch.Tensor:
        if self._embedding is not None:
            hidden = torch.nn.functional.embedding(input_ids[None], self._embedding.weight)
        else:
            hidden = self.text_model.embed_tokens(input_ids[None])
        if step.image_rows is not None:
            # image embeddings may carry more than the hidden width (Qwen3-VL's deepstack features)
            hidden[0, step.image_rows] = step.image_embeds[:, :hidden.shape[-1]].to(hidden.dtype)
        return hidden

    def run_layers(self, hidden: torch.Tensor, step: StepContext, start: int = 0,
                   end: int | None = None) -> torch.Tensor:
        """Layers ``[start, end)`` over packed hidden states ``[1, T, hidden]``."""
        positions = step.batch.positions[None]
        rope = positions if step.rope_positions is None else step.rope_positions
        longest = max(step.batch.kv_lens)
        rows = rotary = None  # the fused layers' rotation, transformers' layers' (made when first run)
        layers = self.text_model.layers
        for i in range(start, self.num_layers if end is None else end):
            fused = self.fused.get(i)
            if fused is not None:
                if rows is None:
                    rows = self.rotation_rows(hidden, rope, longest)
                hidden = fused(hidden[0], *rows, step)[None]
            elif i in self.cross_layers:  # families with cross layers define run_cross_layer
                hidden = self.run_cross_layer(layers[i], hidden, step)
            else:
                if rotary is None:
                    rotary = self.rotary(hidden, rope, longest)
                hidden = layers[i](hidden, position_embeddings=rotary, position_ids=positions,
                                   mmkv_step=step)
            hidden = self.after_layer(i, hidden, step)
        return hidden

    def rotation_rows(self, hidden: torch.Tensor, positions: torch.Tensor,
                      longest: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused layers' cos and signed sine (``rotate``) ``[T, 1, head_dim]`` at
        ``positions``: where the position alone sets them (``rotary_table``), one lookup in a
        table of both, made with the rotary table; otherwise ``rotary``'s, the sine's signs applied."""
        table = self.rotary_table(hidden, longest) if positions.shape[0] == 1 else None
        if table is not None:
            if self._rotation_table is None or self._rotation_table[0] is not table:
                signed_sin = table[1] * rotation_signs(table[1])
                self._rotation_table = (table, torch.stack((table[0], signed_sin), 1))
            both = self._rotation_table[1].index_select(0, positions[0])  # [T, 2, head_dim]
            return both[:, :1], both[:, 1:]
        cos, sin = self.rotary(hidden, positions, longest)
        return cos[0, :, None], sin[0, :, None] * rotation_signs(sin)

    def after_layer(self, i: int, hidden: torch.Tensor, step: StepContext) -> torch.Tensor:
        """What a family adds to the hidden states after layer ``i`` (nothing by default)."""
        return hidden

    def rotary(self, hidden: torch.Tensor, positions: torch.Tensor,
               longest: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary embedding's cos and sin at ``positions`` ``[1, T]``, all below ``longest``.
        Where they depend on the position alone (every RoPE type but the dynamic ones) they are
        read from a table the module computed for the positions so far: the same values, one
        lookup instead of a cos and a sin per step. The table grows by doubling (at least 1024
        positions), so a long-context model pays for the lengths it serves, not its maximum."""
        table = self.rotary_table(hidden, longest)
        if table is None:
            return self.text_model.rotary_emb(hidden, position_ids=positions)
        index = positions[0]
        return table[0].index_select(0, index)[None], table[1].index_select(0, index)[None]

    def rotary_table(self, hidden: torch.Tensor,
                     longest: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The rotary module's cos and sin ``[positions, head_dim]`` for at least ``longest``
        positions, or None where they depend on more than the position (dynamic RoPE types)."""
        module = self.text_model.rotary_emb
        rope_type = getattr(module, "rope_type", "default")
        if "dynamic" in rope_type or rope_type == "longrope":
            return None
        table = self._rotary_table
        if table is None or table[0].dtype != hidden.dtype or table[0].shape[0] < longest:
            size = min(self.max_model_len, max(1024, 1 << (longest - 1).bit_length()))
            every = torch.arange(size, device=hidden.device)[None]
            table = self._rotary_table = tuple(t[0] for t in module(hidden, position_ids=every))
        return table

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head on rows ``[n, hidden]``; float32 logits."""
        logits = self.head(self.final_norm(hidden))
        return logits if logits.dtype == torch.float32 else logits.float()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, step: StepContext,
                logit_rows: torch.Tensor) -> torch.Tensor:
        """Run the packed tokens through the model; float32 logits of the rows in ``logit_rows``."""
        hidden = self.run_layers(self.embed(input_ids, step), step)
        return self.logits(hidden[0, logit_rows])
