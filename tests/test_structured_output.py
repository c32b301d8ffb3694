"""Structured output and logit bias: sampled outputs always match their schema, choice or regex;
greedy output equals transformers' ``generate`` with the same mask as a logits processor; the
constraint survives forks, preemption and prefix hits; bad specs fail at submission."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import llguidance
import llguidance.torch
import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from mmkv import Engine, SamplingParams, StructuredOutput
from mmkv.bench.structured_bench import SCHEMA
from mmkv.synthetic import document_prompt, random_report
from tiny_models import load_hf

@pytest.fixture(scope="module")
def bundled():
    return Engine(kv_cache_memory="64MiB", host_kv_memory="8MiB", debug=True)


def _reports(n: int, question: str, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [document_prompt(random_report(rng), question) for _ in range(n)]


def test_every_sampled_output_validates_against_its_schema(bundled):
    """200 requests sampled at temperature 1 (the bundled model's reports): every output is
    complete JSON that validates against the schema, ended by the model's end-of-sequence token."""
    prompts = _reports(200, "describe the town as json.")
    params = SamplingParams(max_tokens=120, temperature=1.0, seed=3,
                            structured=StructuredOutput(json_schema=SCHEMA))
    outs = bundled.generate(prompts, params)
    for out in outs:
        [o] = out.outputs
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert bundled.stats()["blocks_in_use"] == 0


def test_choices_and_regexes_hold_for_every_sample(bundled):
    prompts = _reports(40, "is the town coastal?", seed=1)
    choice = bundled.generate(prompts, SamplingParams(max_tokens=8, temperature=1.0, seed=1,
                                                      structured=StructuredOutput(choice=["yes", "no", "maybe not"])))
    assert {o.outputs[0].text for o in choice} <= {"yes", "no", "maybe not"}
    pattern = r"[a-z]{2,6} [0-9]{4}"
    lark = bundled.generate(prompts[:8], SamplingParams(max_tokens=16, temperature=1.0, seed=3,
                                                        structured=StructuredOutput(grammar='start: "a" B\nB: /[0-9]{2}/')))
    assert all(re.fullmatch(r"a[0-9]{2}", o.outputs[0].text) for o in lark)
    regex = bundled.generate(prompts, SamplingParams(max_tokens=16, temperature=1.0, seed=2,
                                                     structured=StructuredOutput(regex=pattern)))
    for out in regex:
        assert re.fullmatch(pattern, out.outputs[0].text), out.outputs[0].text
    objects = bundled.generate(prompts[:8], SamplingParams(max_tokens=200, temperature=0.7, seed=4,
                                                           structured=StructuredOutput(json_object=True)))
    for out in objects:
        if out.outputs[0].finish_reason == "stop":
            assert isinstance(json.loads(out.outputs[0].text), dict)


def test_forks_preemption_and_prefix_hits_keep_each_sequence_in_its_grammar():
    """n = 3 samples fork the grammar with the blocks; a pool too small for the batch preempts
    (recompute and swap), and later requests hit the cached document: every output still
    validates, and a seeded request's samples are the same as when it ran alone."""
    params = SamplingParams(max_tokens=80, temperature=1.0, seed=7, n=3,
                            structured=StructuredOutput(json_schema=SCHEMA))
    prompts = _reports(6, "describe the town as json.", seed=5)
    alone = Engine(kv_cache_memory="64MiB", host_kv_memory="8MiB")
    want = [[o.text for o in alone.generate([p], params)[0].outputs] for p in prompts]
    for mode in ("recompute", "swap"):
        tight = Engine(kv_cache_memory=70 * alone.kv.bytes_per_block, host_kv_memory="8MiB",
                       preemption=mode, debug=True)
        got = [[o.text for o in out.outputs] for out in tight.generate(prompts, params)]
        assert tight.stats()[f"preemptions_{mode}"] > 0
        assert got == want
        for texts in got:
            for text in texts:
                jsonschema.validate(json.loads(text), SCHEMA)
    again = alone.generate(prompts[:2], params)
    assert alone.stats()["cached_prompt_tokens"] > 0
    assert [[o.text for o in out.outputs] for out in again] == want[:2]


class _Mask(LogitsProcessor):
    """The same grammar as a transformers logits processor: each step's allowed tokens from a
    matcher of its own, advanced by the tokens generated so far."""

    def __init__(self, tokenizer, grammar: str, prompt_len: int) -> None:
        self.matcher = llguidance.LLMatcher(tokenizer, grammar)
        self.prompt_len, self.seen = prompt_len, 0

    def __call__(self, input_ids, scores):
        for token in input_ids[0, self.prompt_len + self.seen:].tolist():
            assert self.matcher.consume_token(token)
            self.seen += 1
        bitmask = llguidance.torch.allocate_token_bitmask(1, scores.shape[-1])
        llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, 0)
        allowed = ((bitmask[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).bool().view(-1)
        return scores.masked_fill(~allowed[:scores.shape[-1]], float("-inf"))


def test_greedy_output_equals_transformers_with_the_same_mask(model_dirs):
    """On the tiny Llama (a character tokenizer, no end-of-sequence token): a regex and a JSON
    schema, greedy, token for token transformers' ``generate`` with the mask as a logits
    processor; without the mask the outputs differ, so the mask is what made them so."""
    eng = Engine(model_dirs["llama"], device="cpu")
    specs = [StructuredOutput(regex=r"[a-f]{3}-[0-9]{2}\.(x|yz)"),
             StructuredOutput(json_schema={"type": "object", "properties": {"k": {"enum": ["ab", "cd"]},
                                                                                "n": {"type": "integer", "maximum": 99, "minimum": 0}},
                                           "required": ["k", "n"], "additionalProperties": False})]
    model = load_hf(model_dirs["llama"])
    prompts = [list(b"some prompt text"), list(b"another one, longer than the first")]
    for spec in specs:
        outs = eng.generate(prompts, SamplingParams(max_tokens=40, structured=spec))
        plain = eng.generate(prompts, SamplingParams(max_tokens=40))
        grammars = eng.preparer.grammars
        compiled = grammars.compile(spec)
        for prompt, out, free in zip(prompts, outs, plain):
            assert out.outputs[0].finish_reason == "stop"
            tokens = out.outputs[0].token_ids
            with torch.no_grad():
                hf = model.generate(torch.tensor([prompt]), max_new_tokens=len(tokens), do_sample=False,
                                    min_new_tokens=len(tokens),
                                    logits_processor=LogitsProcessorList([_Mask(grammars.tokenizer, compiled, len(prompt))]))
            assert tokens == hf[0, len(prompt):].tolist()
            assert free.outputs[0].token_ids[:len(tokens)] != tokens


def test_constrained_rows_among_free_ones_keep_their_own_outputs(model_dirs):
    """A batch alternating constrained and free requests (the constrained rows not side by side):
    each gives what it gives in a batch of its own kind (a batch of constrained rows alone is
    checked against transformers above), so each mask lands on its own row and on no other."""
    eng = Engine(model_dirs["llama"], device="cpu")
    prompts = [list(f"prompt number {i}, a few words".encode()) for i in range(6)]
    specs = [StructuredOutput(regex=r"[a-f]{3}-[0-9]{2}"), StructuredOutput(regex=r"(yes|no)!"),
             StructuredOutput(json_schema={"type": "object", "properties": {"n": {"type": "integer", "maximum": 99, "minimum": 0}},
                                           "required": ["n"], "additionalProperties": False})]
    constrained = [SamplingParams(max_tokens=12, structured=spec) for spec in specs]
    free = SamplingParams(max_tokens=12)
    mixed = [p for pair in zip([free] * 3, constrained) for p in pair]  # free, constrained, ...
    together = [o.outputs[0].token_ids for o in eng.generate(prompts, mixed)]
    alone = [o.outputs[0].token_ids for o in eng.generate(prompts[1::2], constrained)]
    plain = [o.outputs[0].token_ids for o in eng.generate(prompts[0::2], [free] * 3)]
    assert together[1::2] == alone and together[0::2] == plain
    texts = [bytes(t).decode() for t in alone]  # the byte tokenizer: token ids are the bytes
    assert re.fullmatch(r"[a-f]{3}-[0-9]{2}", texts[0]) and re.fullmatch(r"(yes|no)!", texts[1])
    assert isinstance(json.loads(texts[2])["n"], int)


def test_logit_bias_moves_the_choice_as_transformers_would(model_dirs):
    """A +100 bias on one token makes greedy decoding pick it; a bias that removes the argmax
    gives transformers' output with the same bias."""
    eng = Engine(model_dirs["llama"], device="cpu")
    prompt = list(b"bias me")
    first = eng.generate([prompt], SamplingParams(max_tokens=1))[0].token_ids[0]
    forced = eng.generate([prompt], SamplingParams(max_tokens=4, logit_bias={ord("q"): 100.0}))[0]
    assert forced.token_ids == [ord("q")] * 4
    banned = eng.generate([prompt], SamplingParams(max_tokens=6, logit_bias={first: -100.0}))[0]
    model = load_hf(model_dirs["llama"])
    bias = torch.zeros(256)
    bias[first] = -100.0

    class Bias(LogitsProcessor):
        def __call__(self, input_ids, scores):
            return scores + bias

    with torch.no_grad():
        hf = model.generate(torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                            logits_processor=LogitsProcessorList([Bias()]))
    assert banned.token_ids == hf[0, len(prompt):].tolist() and banned.token_ids[0] != first


@pytest.mark.parametrize("spec, message", [
    (dict(json_schema={"type": "nonsense"}), "invalid json_schema"),
    (dict(json_schema="{not json"), "invalid json_schema"),
    (dict(regex="[unclosed"), "invalid regex"),
    (dict(grammar="start: missing_rule"), "invalid grammar"),
])
def test_a_bad_spec_fails_at_submission_naming_it(bundled, spec, message):
    with pytest.raises(ValueError, match=re.escape(f"request 0: {message}")):
        bundled.generate(["x"], SamplingParams(structured=StructuredOutput(**spec)))
    assert bundled.stats()["blocks_in_use"] == 0 and not bundled.has_unfinished()


def test_bad_structured_and_bias_arguments_are_refused():
    with pytest.raises(ValueError, match="exactly one of json_schema, json_object, choice, regex, grammar; got choice, regex"):
        StructuredOutput(choice=["a"], regex="b")
    with pytest.raises(ValueError, match="choice must be a non-empty list of non-empty strings"):
        StructuredOutput(choice=[])
    with pytest.raises(ValueError, match=r"logit_bias values must be numbers in \[-100, 100\], got 101"):
        SamplingParams(logit_bias={5: 101})
    with pytest.raises(ValueError, match="logit_bias token ids must be >= 0"):
        SamplingParams(logit_bias={-1: 1.0})
    with pytest.raises(ValueError, match="structured must be a StructuredOutput"):
        SamplingParams(structured={"regex": "a"})


def test_a_bias_outside_the_vocabulary_fails_at_submission(bundled):
    with pytest.raises(ValueError, match="request 0: logit_bias names token 5000; the vocabulary has tokens 0 to 1023"):
        bundled.generate(["x"], SamplingParams(logit_bias={5000: 1.0}))


@pytest.mark.parametrize("method", ["early_exit", "draft_model"])
def test_speculation_gives_the_same_constrained_output(method):
    """The bundled pair, greedy under a schema and a choice, and sampled under the schema: each
    verification row is masked by the grammar after the drafts before it, so speculation changes
    no greedy token, every sampled output still validates, and rounds did run."""
    from mmkv.bundled import BUNDLED_DRAFT_MODEL
    from speculative import SpeculativeConfig
    from tiny_models import LEARNING

    prompts = _reports(6, "describe the town as json.", seed=8)
    greedy = [SamplingParams(max_tokens=80, structured=StructuredOutput(json_schema=SCHEMA)),
              SamplingParams(max_tokens=8, structured=StructuredOutput(choice=["yes", "no"]))]
    plain = Engine(kv_cache_memory="64MiB", host_kv_memory="8MiB")
    spec = Engine(kv_cache_memory="64MiB", host_kv_memory="8MiB", debug=True,
                  speculative=SpeculativeConfig(method=method, num_tokens=8, settings=LEARNING,
                                                draft_model=BUNDLED_DRAFT_MODEL if method == "draft_model" else None))
    for params in greedy:
        assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == [
            o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    sampled = spec.generate(prompts, SamplingParams(max_tokens=80, temperature=1.0, seed=5,
                                                    structured=StructuredOutput(json_schema=SCHEMA)))
    for out in sampled:
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
    assert spec.stats()["spec_rounds"] > 0 and spec.stats()["blocks_in_use"] == 0


def test_every_sampled_output_of_a_random_model_validates(model_dirs):
    """The same promise on random weights (the tiny Llama, a character tokenizer and no
    end-of-sequence token): 200 requests sampled at temperature 1 each end when the grammar is
    complete, as JSON that validates."""
    schema = {"type": "object", "properties": {
        "k": {"enum": ["ab", "cd", "e"]}, "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "s": {"type": "string", "maxLength": 5}, "b": {"type": "boolean"}},
        "required": ["k", "n", "s", "b"], "additionalProperties": False}
    eng = Engine(model_dirs["llama"], device="cpu", kv_cache_memory="64MiB", host_kv_memory="4MiB")
    rng = random.Random(9)
    prompts = [[rng.randrange(32, 127) for _ in range(rng.randint(3, 20))] for _ in range(200)]
    outs = eng.generate(prompts, SamplingParams(max_tokens=80, temperature=1.0, seed=11,
                                                structured=StructuredOutput(json_schema=schema)))
    for out in outs:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
