"""Eviction policies through the engine: which cached prefix survives memory pressure.

A VLM whose vision tower costs more per cached block than a text block (as in real VLMs) caches an
image's cross-attention K/V (4 blocks) and a document's K/V; then a long prompt needs exactly 5
blocks more than are free. LRU evicts what was used longest ago, FIFO what was cached first, and
the cost policy (GreedyDual-Size-Frequency over the engine's rebuild FLOPs) what is cheapest to
rebuild given its hits: the document, here, whatever the order. Answers never depend on the policy.
"""

import pytest

from cache import make_keys
from mmkv import Engine, SamplingParams
from tiny_vlms import IMAGE_TOKEN, build_mmkv_vlm, picture

P = SamplingParams(max_tokens=4, ignore_eos=True)
BLOCK_BYTES = 2 * 2 * 4 * 2 * 16 * 4
IMAGE_QUESTION = {"prompt": [IMAGE_TOKEN] + list(b"what?"), "images": [picture(1)]}
DOC = list(b"a document about things")


@pytest.fixture(scope="module")
def heavy_vision_vlm(tmp_path_factory):
    return build_mmkv_vlm(tmp_path_factory.mktemp("heavy") / "vlm", vision_width=128, vision_layers=4)


@pytest.mark.parametrize("refresh, policy, image_kept, doc_kept", [
    (False, "lru", False, True), (False, "fifo", False, True), (False, "cost", True, False),
    (True, "lru", True, False), (True, "fifo", False, True), (True, "cost", True, False)])
def test_the_policy_decides_which_prefix_survives(heavy_vision_vlm, refresh, policy, image_kept,
                                                  doc_kept):
    eng = Engine(heavy_vision_vlm, kv_cache_memory=40 * BLOCK_BYTES, host_kv_memory=1 << 20,
                 block_size=4, device="cpu", eviction_policy=policy, debug=True)
    model = eng.model
    image = model.placement(model.vision.prepare([picture(1)])[0])
    assert model.image_rebuild_flops(image) / 4 > 2 * model.text_rebuild_flops(20, 4)
    image_answers = [eng.generate([IMAGE_QUESTION], P)[0].token_ids]
    eng.generate([DOC + list(b"?")], P)
    if refresh:  # the image is used again after the document
        image_answers.append(eng.generate([IMAGE_QUESTION], P)[0].token_ids)
    stats = eng.stats()
    long_prompt = [i % 200 + 5 for i in range((stats["blocks_free"] + 5) * 4 - 1)]
    eng.generate([long_prompt], SamplingParams(max_tokens=1))
    assert eng.stats()["evictions"] == 5
    doc_cached = eng.kv.tree.match_prefix(make_keys(DOC)).num_tokens
    assert (doc_cached == 20) == doc_kept  # 5 whole blocks of the document's 23 tokens
    image_answers.append(eng.generate([IMAGE_QUESTION], P)[0].token_ids)
    recomputed = eng.stats()["xattn_blocks_computed"] - stats["xattn_blocks_computed"]
    assert recomputed == (0 if image_kept else 4)
    assert all(a == image_answers[0] for a in image_answers)
    assert eng.stats()["blocks_in_use"] == 0


def test_cached_blocks_carry_the_engines_rebuild_cost(heavy_vision_vlm):
    """Text blocks are cached with the FLOPs of recomputing them at their positions, image blocks
    with the cost of encoding the image and projecting its K/V (what the cost policy weighs)."""
    eng = Engine(heavy_vision_vlm, kv_cache_memory=64 * BLOCK_BYTES, host_kv_memory=1 << 20,
                 block_size=4, device="cpu", eviction_policy="cost")
    eng.generate([IMAGE_QUESTION, DOC + list(b"?")], P)  # 24-token prompt, 27 tokens computed
    model = eng.model
    image = model.placement(model.vision.prepare([picture(1)])[0])
    costs = {tuple(n.blocks): n.cost_per_block for n in eng.kv.tree._nodes() if n.blocks}
    doc_blocks = eng.kv.tree.match_prefix(make_keys(DOC + list(b"?"))).blocks
    assert len(doc_blocks) == 6  # the prompt, cached in one insert when its prefill ended
    assert costs[tuple(doc_blocks)] == pytest.approx(model.text_rebuild_flops(0, 24) / 6)
    assert pytest.approx(model.image_rebuild_flops(image) / 4) in costs.values()
