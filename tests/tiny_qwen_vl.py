"""Tiny random Qwen2-VL, Qwen2.5-VL and Qwen3-VL checkpoints, their processors, and the oracle.

Each checkpoint has a byte-level ``Qwen2Tokenizer`` (token id = byte value, no merges) plus the
Qwen special tokens, a chat template in Qwen's format, an image processor whose min/max pixels
give 4 to 16 image tokens, and no EOS, so every answer runs to its full length.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import (AutoProcessor, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration,
                          Qwen2_5_VLProcessor, Qwen2Tokenizer, Qwen2VLConfig,
                          Qwen2VLForConditionalGeneration, Qwen2VLImageProcessor, Qwen2VLProcessor,
                          Qwen2VLVideoProcessor, Qwen3VLConfig, Qwen3VLForConditionalGeneration,
                          Qwen3VLProcessor, Qwen3VLVideoProcessor)
from transformers.utils import logging as hf_logging

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|image_pad|>", "<|video_pad|>"]
ENDOFTEXT, IM_START, IM_END, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = range(256, 263)
VOCAB = 264
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")

TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            head_dim=16, num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=512,
            initializer_range=0.15, bos_token_id=None, eos_token_id=None, pad_token_id=None,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
TOKENS = dict(image_token_id=IMAGE_PAD, video_token_id=VIDEO_PAD,
              vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)
VISION = dict(depth=2, num_heads=2, spatial_merge_size=2, temporal_patch_size=2,
              initializer_range=0.15)
FAMILIES = {  # config, model, processor, video processor, vision config
    "qwen2_vl": (Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor,
                 Qwen2VLVideoProcessor,
                 dict(VISION, embed_dim=32, hidden_size=64, mlp_ratio=2, patch_size=14)),
    "qwen2_5_vl": (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor,
                   Qwen2VLVideoProcessor,
                   dict(VISION, hidden_size=32, intermediate_size=64, out_hidden_size=64,
                        patch_size=14, window_size=56, fullatt_block_indexes=[1])),
    "qwen3_vl": (Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor,
                 Qwen3VLVideoProcessor,
                 dict(VISION, hidden_size=32, intermediate_size=64, out_hidden_size=64,
                      patch_size=16, num_position_embeddings=16, deepstack_visual_indexes=[0, 1])),
}


def bytes_to_unicode() -> dict[int, str]:
    """The byte-level BPE alphabet: printable bytes stand for themselves, the others for the
    code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = iter(range(256, 512))
    return {b: chr(b if b in printable else next(shifted)) for b in range(256)}


def save_tokenizer(directory: Path) -> Qwen2Tokenizer:
    """A byte-level Qwen2Tokenizer whose token ids are the bytes (0..255), then the specials."""
    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], eos_token=None, unk_token=None,
                         pad_token=SPECIALS[0])
    tok.add_special_tokens({"additional_special_tokens": SPECIALS[1:]})
    assert [tok.convert_tokens_to_ids(s) for s in SPECIALS] == list(range(256, 263))
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(directory)
    return tok


def build_qwen_vl(family: str, directory: Path, seed: int = 0, quiet_from: int | None = None) -> Path:
    """Save a seeded random ``family`` model, its tokenizer and its processors into ``directory``.
    With ``quiet_from``, text layers from that one on write a tenth of their usual output, so an
    early exit there mostly agrees with the whole model (speculation gets accepted drafts)."""
    hf_logging.disable_progress_bar()
    config_cls, model_cls, processor_cls, video_cls, vision = FAMILIES[family]
    config = config_cls(text_config=TEXT, vision_config=vision, initializer_range=0.15, **TOKENS)
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():
        for name, p in model.model.language_model.named_parameters():
            if name.endswith(".bias"):  # Q/K/V biases start at 0: make them count
                p.normal_(0, 0.15)
        quiet = model.model.language_model.layers[quiet_from:] if quiet_from is not None else []
        for layer in quiet:
            layer.self_attn.o_proj.weight.mul_(0.1)
            layer.mlp.down_proj.weight.mul_(0.1)
    model.save_pretrained(directory)
    patch = vision["patch_size"]
    factor = patch * 2  # each side a multiple of patch × merge
    images = Qwen2VLImageProcessor(min_pixels=4 * factor * factor, max_pixels=16 * factor * factor,
                                   patch_size=patch, merge_size=2)
    tokenizer = save_tokenizer(directory)
    videos = video_cls(patch_size=patch, merge_size=2)
    processor_cls(image_processor=images, tokenizer=tokenizer, video_processor=videos,
                  chat_template=CHAT_TEMPLATE).save_pretrained(directory)
    return directory


def picture(seed: int, size=(84, 56)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")


def load_oracle(family: str, directory: Path):
    """transformers' model (fp32) and processor for ``directory``."""
    model = FAMILIES[family][1].from_pretrained(directory, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(directory)


@torch.inference_mode()
def hf_greedy(model, processor, text: str, images: list[Image.Image],
              new: int) -> tuple[list[int], list[int]]:
    """The oracle: the processor's prompt ids and transformers' greedy ``generate`` with M-RoPE
    (``mm_token_type_ids`` and ``image_grid_thw``), each image encoded alone by the model's own
    ``get_image_features``."""
    inputs = processor(text=[text], images=images or None, return_tensors="pt")
    kwargs = dict(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                  mm_token_type_ids=inputs["mm_token_type_ids"])
    if images:
        outs = [model.model.get_image_features(**processor.image_processor(images=[img], return_tensors="pt"))
                for img in images]
        fields = {"pooler_output": tuple(o.pooler_output[0] for o in outs)}
        if getattr(outs[0], "deepstack_features", None) is not None:  # Qwen3-VL
            fields["deepstack_features"] = [tuple(o.deepstack_features[layer][0] for o in outs)
                                            for layer in range(len(outs[0].deepstack_features))]
        encoded = type(outs[0])(**fields)
        kwargs.update(image_grid_thw=inputs["image_grid_thw"], mm_encoder_outputs={"image": encoded})
    out = model.generate(**kwargs, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    prompt = inputs["input_ids"][0].tolist()
    return prompt, out[0, len(prompt):].tolist()
