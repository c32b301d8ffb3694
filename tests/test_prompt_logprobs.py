"""Prompt log-probabilities (``SamplingParams(prompt_logprobs=k)``) against transformers.

The oracle is the log-softmax of transformers' logits over the whole prompt on the same fp32
weights: position ``p``'s row scores prompt token ``p + 1``.
"""

from __future__ import annotations

import pytest
import torch

from mmkv import Engine, SamplingParams
from tiny_models import load_hf

PROMPTS = [list(b"the cat sat on the mat and the cat sat"), list(b"abcabcabcabc"), list(b"x" * 40)]


def hf_prompt_logprobs(model, prompt: list[int], k: int) -> list[tuple[float, list[int], list[float]]]:
    """For tokens 1.. of ``prompt``: (its log-probability, the ``k`` likeliest ids and theirs)."""
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
    values, ids = torch.topk(logprobs, k)
    return [(float(logprobs[p, prompt[p + 1]]), ids[p].tolist(), values[p].tolist())
            for p in range(len(prompt) - 1)]


def check(got, prompt: list[int], want, k: int) -> None:
    assert got[0] is None and len(got) == len(prompt)
    for entry, token, (logprob, ids, values) in zip(got[1:], prompt[1:], want):
        assert entry.token_id == token and entry.logprob == pytest.approx(logprob, abs=1e-4)
        assert [i for i, _ in entry.top] == ids[:k]
        assert [v for _, v in entry.top] == pytest.approx(values[:k], abs=1e-4)


@pytest.fixture(scope="module")
def llama(model_dirs):
    return model_dirs["llama"], load_hf(model_dirs["llama"])


def test_prompt_logprobs_equal_transformers_in_chunks_and_batches(llama):
    """Prompts prefilled in chunks of 8 tokens beside one that asked for none: each scored prompt
    token equals transformers' log-softmax, with its k alternatives; the output is as without."""
    path, model = llama
    engine = Engine(path, device="cpu", max_num_batched_tokens=8, debug=True)
    params = [SamplingParams(max_tokens=4, prompt_logprobs=k) for k in (0, 3, 5)]
    outs = engine.generate(PROMPTS, params)
    for prompt, out, p in zip(PROMPTS, outs, params):
        check(out.prompt_logprobs, prompt, hf_prompt_logprobs(model, prompt, 5), p.prompt_logprobs)
    plain = engine.generate(PROMPTS, SamplingParams(max_tokens=4))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert all(o.prompt_logprobs is None for o in plain)


def test_a_cached_prefix_is_computed_again_for_prompt_logprobs(llama):
    """A prompt the cache holds is computed again for a request that scores it (its tokens would
    have no logits), while a request that does not ask still reads the cache."""
    path, model = llama
    engine = Engine(path, device="cpu", debug=True)
    prompt = PROMPTS[0] * 3
    engine.generate([prompt], SamplingParams(max_tokens=2))
    again = engine.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=2))[0]
    assert again.cached_tokens == 0
    check(again.prompt_logprobs, prompt, hf_prompt_logprobs(model, prompt, 2), 2)
    assert engine.generate([prompt], SamplingParams(max_tokens=2))[0].cached_tokens > 0


def test_max_tokens_zero_computes_the_prompt_only(llama):
    path, model = llama
    engine = Engine(path, device="cpu", debug=True)
    out = engine.generate(PROMPTS, SamplingParams(max_tokens=0, prompt_logprobs=1))
    for prompt, o in zip(PROMPTS, out):
        assert o.finished and o.outputs[0].token_ids == [] and o.outputs[0].finish_reason == "length"
        check(o.prompt_logprobs, prompt, hf_prompt_logprobs(model, prompt, 1), 1)
    assert engine.stats()["blocks_in_use"] == 0 and not engine.has_unfinished()
    with pytest.raises(ValueError, match="max_tokens=0 \\(the prompt only\\) takes n=1, got n=2"):
        SamplingParams(max_tokens=0, n=2)
    with pytest.raises(ValueError, match="prompt_logprobs must be <= 20, got 21"):
        SamplingParams(prompt_logprobs=21)


def test_prompt_logprobs_survive_preemption(llama):
    """Requests preempted while prefilling in a pool too small for them all (recompute and swap)
    still score every prompt token as transformers does."""
    path, model = llama
    prompts = [p * 4 for p in PROMPTS]
    for mode in ("recompute", "swap"):
        probe = Engine(path, device="cpu")
        tight = Engine(path, device="cpu", kv_cache_memory=14 * probe.kv.bytes_per_block, host_kv_memory="8MiB",
                       preemption=mode, max_num_batched_tokens=16, debug=True)
        outs = tight.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True, prompt_logprobs=2))
        assert tight.stats()[f"preemptions_{mode}"] > 0
        for prompt, out in zip(prompts, outs):
            check(out.prompt_logprobs, prompt, hf_prompt_logprobs(model, prompt, 2), 2)
