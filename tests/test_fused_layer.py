"""mmkv's fused decoder layer against transformers' modules: the same logits bit for bit.

Each family runs the same requests (prompt chunks, decode steps, a shared prefix served by
cascade attention) twice on one engine: through the fused layers, then through transformers'
own decoder layers (the fused layers removed), capturing every step's logits.
"""

import pytest
import torch

from mmkv import SamplingParams
from test_engine_oracle import engine, prompts
from test_multimodal import q, vlm_engine
from tiny_models import FAMILIES
from tiny_vlms import picture

P = SamplingParams(max_tokens=8, ignore_eos=True)


def captured_logits(eng, requests) -> list[torch.Tensor]:
    logits = []
    forward = eng.model.forward

    def spy(input_ids, step, rows):
        out = forward(input_ids, step, rows)
        logits.append(out.clone())
        return out

    eng.model.forward = spy
    eng.generate(requests, P)
    del eng.model.forward
    return logits


def assert_same_as_modules(eng, requests) -> None:
    assert eng.model.fused, "no layer of this family runs fused"
    fused = captured_logits(eng, requests)
    eng.kv.tree.evict(eng.kv.pool.num_blocks)  # the second run reuses nothing cached
    eng.model.fused = {}
    modules = captured_logits(eng, requests)
    assert len(fused) == len(modules) >= P.max_tokens
    for a, b in zip(fused, modules):
        assert torch.equal(a, b), (a - b).abs().max()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_text_families(model_dirs, family):
    [doc] = prompts(30, [37])
    requests = [doc + p for p in prompts(31, [3, 9, 20])] + prompts(32, [5])
    assert_same_as_modules(engine(model_dirs, family, max_num_batched_tokens=40), requests)


@pytest.mark.parametrize("family", ["mllama", "llava", "mmkv_vlm"])
def test_vision_language_families(vlm_dirs, family):
    requests = [{"prompt": q(text), "images": [picture(50)]} for text in ("what?", "where is it?")]
    assert_same_as_modules(vlm_engine(vlm_dirs, family), requests + [list(b"text only prompt")])
