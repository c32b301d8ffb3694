"""Each response says what its prompt took from the caches (``RequestOutput.reuse``, the server's
``usage.mmkv``): images, encoder runs, cross-attention K/V blocks computed and reused, prompt
tokens computed; cached tokens count an in-prompt image's positions when they came from the tree."""

from __future__ import annotations

import pytest

from mmkv import SamplingParams
from test_multimodal import q, vlm_engine
from tiny_vlms import picture

P = SamplingParams(max_tokens=4, ignore_eos=True)


@pytest.mark.parametrize("family", ["mllama", "mmkv_vlm"])
def test_a_cross_attention_image_is_computed_once_and_reused_after(vlm_dirs, family):
    """Three questions about one image, one at a time, then a new image: the first question
    encodes the image and computes its cross-attention blocks, the next two take them."""
    eng = vlm_engine(vlm_dirs, family)
    image = picture(3)
    reuses = [eng.generate([{"prompt": q(text), "images": [image]}], P)[0].reuse
              for text in ("What is it?", "How many?", "Which colour?")]
    first, *later = reuses
    assert first.images == 1 and first.images_encoded == 1
    blocks = first.xattn_blocks_computed
    assert blocks > 0 and first.xattn_blocks_reused == 0
    for reuse in later:
        assert (reuse.images, reuse.images_encoded, reuse.xattn_blocks_computed,
                reuse.xattn_blocks_reused) == (1, 0, 0, blocks)
    other = eng.generate([{"prompt": q("And this?"), "images": [picture(4)]}], P)[0].reuse
    assert other.images_encoded == 1 and other.xattn_blocks_computed == blocks
    assert eng.stats()["encoder_calls"] == 2


def test_an_in_prompt_image_counts_its_cached_positions(vlm_dirs):
    """LLaVA's image tokens sit in the radix tree: a second request with the same image and text
    before the question takes the image's positions from the cache (counted in cached_tokens),
    and its encoder does not run; a request served together with the first counts one encoder
    run between them."""
    eng = vlm_engine(vlm_dirs, "llava")
    image = picture(5)
    together = eng.generate([{"prompt": list(b"Look: ") + q("What is it?"), "images": [image]},
                             {"prompt": list(b"Look: ") + q("How many?"), "images": [image]}], P)
    assert sum(o.reuse.images_encoded for o in together) == 1
    again = eng.generate([{"prompt": list(b"Look: ") + q("Colour?"), "images": [image]}], P)[0]
    shared = len(again.prompt_token_ids) - len(b"Colour?")  # "Look: " and the image's tokens
    assert again.reuse.images_encoded == 0
    assert again.cached_tokens == shared > len(b"Look: ") + 1
    assert again.reuse.prompt_tokens_computed == len(again.prompt_token_ids) - again.cached_tokens


def test_reset_prefix_cache_makes_the_next_request_start_cold(vlm_dirs):
    """After ``reset_prefix_cache`` the same request computes everything again: its prefix, its
    image's encoder output and cross-attention K/V (what the examples time from cold caches)."""
    eng = vlm_engine(vlm_dirs, "mllama")
    request = {"prompt": list(b"Long shared text before it: ") + q("What is it?"), "images": [picture(6)]}
    first = eng.generate([request], P)[0]
    warm = eng.generate([request], P)[0]
    assert warm.cached_tokens > 0 and warm.reuse.images_encoded == 0
    eng.reset_prefix_cache()
    cold = eng.generate([request], P)[0]
    assert cold.cached_tokens == 0 and cold.reuse == first.reuse
    assert cold.token_ids == first.token_ids and eng.stats()["blocks_in_use"] == 0
