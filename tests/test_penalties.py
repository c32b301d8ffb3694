"""Presence, frequency and repetition penalties, ``min_tokens`` and ``min_p`` against transformers.

The oracle for greedy outputs is transformers' ``generate`` on the same fp32 weights with
``RepetitionPenaltyLogitsProcessor``, ``MinNewTokensLengthLogitsProcessor`` and, for OpenAI's
presence and frequency penalties (which transformers lacks), the plain rule written out below over
the generated tokens only.
"""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch
from transformers import (LogitsProcessor, LogitsProcessorList, MinNewTokensLengthLogitsProcessor,
                          MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                          TopKLogitsWarper, TopPLogitsWarper)

from mmkv import Engine, SamplingParams, StructuredOutput
from mmkv.bench.structured_bench import SCHEMA
from mmkv.sampler import filtered_probs
from tiny_models import load_hf

PROMPTS = [list(b"the cat sat on the mat and the cat"), list(b"abcabcabc"), list(b"penalties!")]
PENALTIES = {
    "repetition": dict(repetition_penalty=1.5),
    "repetition_below_one": dict(repetition_penalty=0.7),
    "frequency": dict(frequency_penalty=1.5),
    "presence": dict(presence_penalty=1.2),
    "negative_frequency": dict(frequency_penalty=-0.8),
    "mix": dict(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.4),
}


class OutputPenalties(LogitsProcessor):
    """OpenAI's rule: ``f`` times a token's count in the output so far, then ``p`` if it occurs."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        for row, ids in enumerate(input_ids[:, self.prompt_len:].tolist()):
            for token in set(ids):
                if self.frequency:
                    scores[row, token] -= self.frequency * ids.count(token)
                if self.presence:
                    scores[row, token] -= self.presence
        return scores


def hf_penalised(model, prompt: list[int], max_new_tokens: int, repetition_penalty: float = 1.0,
                 frequency_penalty: float = 0.0, presence_penalty: float = 0.0, min_tokens: int = 0,
                 stop_token: int | None = None) -> list[int]:
    """transformers' greedy output under the same penalties (never stopping early unless
    ``stop_token`` is given, which ``min_tokens`` then holds off)."""
    processors = []
    if repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(repetition_penalty))
    if frequency_penalty or presence_penalty:
        processors.append(OutputPenalties(len(prompt), frequency_penalty, presence_penalty))
    if min_tokens:
        processors.append(MinNewTokensLengthLogitsProcessor(len(prompt), min_tokens, [stop_token]))
    stops = dict(eos_token_id=stop_token) if stop_token is not None else dict(min_new_tokens=max_new_tokens)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=0, logits_processor=LogitsProcessorList(processors), **stops)
    tokens = out[0, len(prompt):].tolist()
    return tokens[:tokens.index(stop_token) + 1] if stop_token in tokens else tokens


@pytest.fixture(scope="module")
def llama(model_dirs):
    return Engine(model_dirs["llama"], device="cpu", debug=True), load_hf(model_dirs["llama"])


@pytest.mark.parametrize("name", sorted(PENALTIES))
def test_greedy_penalised_output_equals_transformers(llama, name):
    """Each penalty alone and mixed, on a batch where unpenalised rows sit between penalised ones:
    every row equals transformers with its own processors (or none)."""
    engine, model = llama
    penalty = PENALTIES[name]
    params = [SamplingParams(max_tokens=24, ignore_eos=True, **penalty), SamplingParams(max_tokens=24, ignore_eos=True)]
    batch = [(p, params[i % 2]) for i, p in enumerate(PROMPTS + PROMPTS[:1])]
    outputs = [o.outputs[0].token_ids for o in engine.generate([p for p, _ in batch], [q for _, q in batch])]
    for (prompt, q), got in zip(batch, outputs):
        want = hf_penalised(model, prompt, 24, **(penalty if q.penalised else {}))
        assert got == want, (name, prompt)
    plain = [o.outputs[0].token_ids for o in engine.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True))]
    assert any(got != p for got, p in zip(outputs[::2], plain[::2])), "the penalty changed nothing"


def test_min_tokens_holds_off_the_stop_token_as_transformers_does(llama):
    """The stop token greedy decoding picks first ends a plain request at once; with
    ``min_tokens`` it is refused until then, as transformers' ``min_new_tokens`` refuses it."""
    engine, model = llama
    prompt = PROMPTS[2]
    stop = engine.generate([prompt], SamplingParams(max_tokens=1))[0].outputs[0].token_ids[0]
    ended = engine.generate([prompt], SamplingParams(max_tokens=20, stop_token_ids=[stop]))[0].outputs[0]
    assert ended.token_ids == [stop]
    for min_tokens in (3, 8):
        got = engine.generate([prompt], SamplingParams(max_tokens=20, stop_token_ids=[stop],
                                                       min_tokens=min_tokens, repetition_penalty=1.1))
        want = hf_penalised(model, prompt, 20, repetition_penalty=1.1, min_tokens=min_tokens, stop_token=stop)
        assert got[0].outputs[0].token_ids == want and len(want) > min_tokens


def test_min_tokens_holds_off_stop_strings_too():
    """As in vLLM, a stop string completed within the first ``min_tokens`` tokens does not end the
    output: it ends at the first one completed after them."""
    engine = Engine(kv_cache_memory="32MiB")
    prompt = "report on kalo. population 452,031. founded 1920.\ninstruction: summarise the report.\nanswer:"
    whole = engine.generate(prompt, SamplingParams(max_tokens=40))[0].outputs[0]
    first = engine.generate(prompt, SamplingParams(max_tokens=40, stop=[","]))[0].outputs[0]
    assert "," in whole.text and first.text == whole.text[:whole.text.index(",")]
    past = len(first.token_ids) + 1  # the comma's own token is within min_tokens
    held = engine.generate(prompt, SamplingParams(max_tokens=40, stop=[","], min_tokens=past))[0].outputs[0]
    assert held.text == whole.text[:whole.text.index(",", len(first.text) + 1)]


def test_each_of_n_samples_counts_its_own_tokens(llama):
    """n = 3 samples drawn with top_k = 1 (the sampled path, whose one candidate is the argmax):
    each equals transformers' greedy output under the penalties, as it would not if the samples
    shared their counts or counted the prompt's tokens."""
    engine, model = llama
    penalty = PENALTIES["mix"]
    params = SamplingParams(max_tokens=20, ignore_eos=True, temperature=1.0, top_k=1, seed=3, n=3, **penalty)
    for prompt, out in zip(PROMPTS, engine.generate(PROMPTS, params)):
        want = hf_penalised(model, prompt, 20, **penalty)
        assert [o.token_ids for o in out.outputs] == [want] * 3


def test_prefix_hits_and_preemption_keep_the_penalised_output(llama, model_dirs):
    """A prompt served from the prefix cache, and requests preempted (recompute and swap) in a
    pool too small for them, still count every prompt and output token."""
    engine, model = llama
    penalty = PENALTIES["mix"]
    params = SamplingParams(max_tokens=40, ignore_eos=True, **penalty)
    prompts = [p * 3 for p in PROMPTS]
    want = [hf_penalised(model, p, 40, **penalty) for p in prompts]
    for _ in range(2):
        assert [o.outputs[0].token_ids for o in engine.generate(prompts, params)] == want
    assert engine.stats()["cached_prompt_tokens"] > 0
    for mode in ("recompute", "swap"):
        tight = Engine(model_dirs["llama"], device="cpu", kv_cache_memory=10 * engine.kv.bytes_per_block,
                       host_kv_memory="8MiB", preemption=mode, debug=True)
        assert [o.outputs[0].token_ids for o in tight.generate(prompts, params)] == want
        assert tight.stats()[f"preemptions_{mode}"] > 0


@pytest.mark.parametrize("method", ["early_exit", "draft_model"])
def test_speculation_gives_the_same_penalised_output(method):
    """The bundled pair in fixed rounds (every step drafts), greedy, with every penalty, with
    ``min_tokens``, and with a penalty under a JSON schema: each verification row counts the
    drafts before it, so speculation changes no token."""
    from mmkv.bundled import BUNDLED_DRAFT_MODEL
    from mmkv.synthetic import document_prompt, random_report
    from speculative import SpeculativeConfig
    from tiny_models import LEARNING

    rng = random.Random(4)
    prompts = [document_prompt(random_report(rng), "describe the town as json.") for _ in range(3)]
    plain = Engine(kv_cache_memory="64MiB")
    spec = Engine(kv_cache_memory="64MiB", debug=True,
                  speculative=SpeculativeConfig(method=method, num_tokens=8, draft_length="fixed", settings=LEARNING,
                                                draft_model=BUNDLED_DRAFT_MODEL if method == "draft_model" else None))
    cases = [SamplingParams(max_tokens=32, repetition_penalty=3.0),
             SamplingParams(max_tokens=32, frequency_penalty=2.0, presence_penalty=2.0),
             SamplingParams(max_tokens=32, frequency_penalty=-2.0, min_tokens=28),
             SamplingParams(max_tokens=80, repetition_penalty=1.3, structured=StructuredOutput(json_schema=SCHEMA))]
    for params in cases:
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
        assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == want
        assert want != [o.outputs[0].token_ids for o in plain.generate(
            prompts, SamplingParams(max_tokens=params.max_tokens, structured=params.structured))]
    for out in spec.generate(prompts, cases[-1]):
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
    assert spec.stats()["spec_accepted_tokens"] > 0 and spec.stats()["blocks_in_use"] == 0


def test_filtered_probs_follow_transformers_warpers():
    """Temperature, top-k, top-p and min-p give the distribution transformers' warpers give, in
    transformers' order."""
    torch.manual_seed(0)
    logits = torch.randn(4, 200) * 3
    for temperature, top_k, top_p, min_p in [(0.7, 0, 1.0, 0.1), (1.0, 50, 0.9, 0.05), (1.3, 0, 0.8, 0.2)]:
        warpers = [TemperatureLogitsWarper(temperature)]
        warpers += [TopKLogitsWarper(top_k)] if top_k else []
        warpers += [TopPLogitsWarper(top_p)] if top_p < 1 else []
        warpers += [MinPLogitsWarper(min_p)]
        want = torch.softmax(LogitsProcessorList(warpers)(None, logits.clone()), -1)
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        got = torch.stack([filtered_probs(row, params) for row in logits])
        assert torch.allclose(got, want, atol=1e-6)
        assert ((got > 0) == (want > 0)).all()
        assert (got > 0).sum() < (filtered_probs(logits[0], SamplingParams(temperature=temperature)) > 0).sum() * 4


@pytest.mark.parametrize("field, value, message", [
    ("presence_penalty", 2.5, r"presence_penalty must be a number in \[-2, 2\], got 2.5"),
    ("frequency_penalty", "1", r"frequency_penalty must be a number in \[-2, 2\], got '1'"),
    ("repetition_penalty", 0.0, "repetition_penalty must be a finite number > 0, got 0.0"),
    ("min_tokens", -1, "min_tokens must be >= 0, got -1"),
    ("min_tokens", 17, r"min_tokens must be <= max_tokens \(16\), got 17"),
    ("min_p", 1.0, r"min_p must be in \[0, 1\), got 1.0"),
])
def test_a_bad_value_is_refused_naming_its_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})
