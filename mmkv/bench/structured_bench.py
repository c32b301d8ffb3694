"""Structured output's cost: tokens/s with and without a JSON schema on the bundled model.

The bundled model answers ``--requests`` report questions ("describe the town as json.") at batch
32 (all at once) and ``--batch1-requests`` of them one at a time, greedy, at most ``--max-tokens``
tokens each, constrained by a schema of four fields (a bounded string, a bounded integer, an enum
array, a boolean), and free, each request made to generate as many tokens as its constrained
answer had (so both make the same tokens from the same prompts). Per batch size: generated tokens per second of each (the
fastest of ``--repeats`` runs on fresh engines), their ratio
(``schema_vs_free_tokens_per_s_b1`` / ``_b32``), and the microseconds the masks took per
constrained token (filling and applying them, ``mask_us_per_token_b1`` / ``_b32``).
``all_outputs_valid``: every constrained output parses as JSON and validates against the schema.

``--libraries`` also times the two grammar libraries alone (llguidance, mmkv's, and xgrammar, when
``make bench-peers`` installed it) on the bundled tokenizer and on a 32,000-token byte-level BPE
trained here: compiling the schema and filling one sequence's mask per token at batch 1 and 32
over random walks through the grammar, and whether any mask lets a raw control character into a
JSON string (which ``json.loads`` refuses).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import tempfile
import time

from mmkv import Engine, SamplingParams, StructuredOutput
from mmkv import runner as runner_module
from mmkv.bench import gc_paused
from mmkv.bundled import BUNDLED_MODEL
from mmkv.synthetic import document_prompt, random_report

SCHEMA = {
    "type": "object",
    "properties": {
        "mayor": {"type": "string", "maxLength": 12},
        "founded": {"type": "integer", "minimum": 1000, "maximum": 2100},
        "industries": {"type": "array", "items": {"enum": ["fishing", "mining", "tourism"]}, "maxItems": 3},
        "coastal": {"type": "boolean"},
    },
    "required": ["mayor", "founded", "coastal"],
    "additionalProperties": False,
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=32, help="served together (batch 32)")
    p.add_argument("--batch1-requests", type=int, default=8, help="served one at a time")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--libraries", action="store_true", help="also time llguidance and xgrammar alone")


class _MaskClock:
    """Times every ``apply_masks`` call of the runner while it is installed."""

    def __init__(self) -> None:
        self.seconds, self.original = 0.0, runner_module.apply_masks

    def __call__(self, logits, rows, constraints, biases) -> None:
        start = time.perf_counter()
        self.original(logits, rows, constraints, biases)
        self.seconds += time.perf_counter() - start

    def __enter__(self) -> _MaskClock:
        runner_module.apply_masks = self
        return self

    def __exit__(self, *exc) -> None:
        runner_module.apply_masks = self.original


def _serve(prompts: list[str], batch: int, params: list[SamplingParams]) -> tuple[list, float, float]:
    """Outputs, seconds and mask seconds of ``prompts`` (each with its ``params``) served
    ``batch`` at a time on a fresh engine."""
    engine = Engine(BUNDLED_MODEL, kv_cache_memory="256MiB", host_kv_memory="16MiB")
    engine.generate(["warm up on a prompt the run never serves"], params[0])
    outs = []
    with _MaskClock() as clock, gc_paused():
        start = time.perf_counter()
        for i in range(0, len(prompts), batch):
            outs += [o.outputs[0] for o in engine.generate(prompts[i:i + batch], params[i:i + batch])]
        return outs, time.perf_counter() - start, clock.seconds


def run(args: argparse.Namespace) -> dict:
    import jsonschema

    rng = random.Random(args.seed)
    prompts = [document_prompt(random_report(rng), "describe the town as json.") for _ in range(args.requests)]
    schema = SamplingParams(max_tokens=args.max_tokens, structured=StructuredOutput(json_schema=SCHEMA))
    result: dict = {}
    valid = True
    for name, served, batch in (("b1", prompts[:args.batch1_requests], 1), ("b32", prompts, len(prompts))):
        rates = {}
        lengths = [len(o.token_ids) for o in _serve(served, batch, [schema] * len(served))[0]]
        # unconstrained, each request as long as its constrained answer: the same tokens to make
        free = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
        for label, params in (("free", free), ("schema", [schema] * len(served))):
            best, mask_us = math.inf, 0.0
            for _ in range(args.repeats):
                outs, seconds, mask_seconds = _serve(served, batch, params)
                tokens = sum(len(o.token_ids) for o in outs)
                if seconds < best:
                    best, mask_us = seconds, 1e6 * mask_seconds / max(tokens, 1)
                if label == "schema":
                    for o in outs:
                        try:
                            jsonschema.validate(json.loads(o.text), SCHEMA)
                        except (ValueError, jsonschema.ValidationError):
                            valid = False
            rates[label] = tokens / best
            result[f"tokens_per_s_{label}_{name}"] = round(rates[label], 1)
            if label == "schema":
                result[f"mask_us_per_token_{name}"] = round(mask_us, 1)
        result[f"schema_vs_free_tokens_per_s_{name}"] = round(rates["schema"] / rates["free"], 3)
    result["all_outputs_valid"] = valid
    if args.libraries:
        result["libraries"] = libraries(args)
    return result


def libraries(args: argparse.Namespace) -> dict:
    """Each library alone: schema compile seconds, mask fill µs per token at batch 1 and 32,
    and whether a mask admitted a raw control character inside a JSON string."""
    from transformers import AutoTokenizer

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        tokenizers = {"bundled": AutoTokenizer.from_pretrained(BUNDLED_MODEL), "bpe32k": _bpe32k(tmp)}
        for name, tokenizer in tokenizers.items():
            for library in ("llguidance", "xgrammar"):
                try:
                    walk = _LIBRARIES[library](tokenizer, len(tokenizer))
                except ImportError:
                    out[f"{library}_{name}"] = "not installed (make bench-peers)"
                    continue
                out[f"{library}_{name}"] = {f"fill_us_per_token_b{b}": round(walk(b, 40, random.Random(b))[0], 1)
                                            for b in (1, 32)}
                compile_s, control = walk(1, 0, None)[1:]
                out[f"{library}_{name}"].update(compile_seconds=round(compile_s, 4),
                                                 control_characters_in_strings=control)
    return out


def _bpe32k(directory: str):
    """A byte-level BPE of 32,000 tokens trained on made-up JSON-ish text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    rng = random.Random(0)
    words = ["".join(rng.choice('abcdefghijklmnopqrstuvwxyz{}[]":,0123456789 ') for _ in range(rng.randint(2, 12)))
             for _ in range(60000)]
    text = (" ".join(rng.choice(words) for _ in range(50)) for _ in range(4000))
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=32000, special_tokens=["</s>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")


def _control_tokens(tokenizer, vocab: int) -> set[int]:
    return {i for i in range(vocab) if any(ord(c) < 32 for c in tokenizer.decode([i]))}


def _llguidance(tokenizer, vocab: int):
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    lltok = llguidance.hf.from_tokenizer(tokenizer, vocab)
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
    llguidance.LLMatcher(lltok, grammar).compute_bitmask()
    compile_s = time.perf_counter() - start
    control = _control_tokens(tokenizer, vocab)

    def walk(batch: int, steps: int, rng: random.Random | None):
        matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(batch)]
        if rng is None:  # inside the mayor's string: may a control character come next?
            m = matchers[0]
            for t in tokenizer.encode('{"mayor":"ab', add_special_tokens=False):
                m.consume_token(t)
            mask = lt.allocate_token_bitmask(1, vocab)
            lt.fill_next_token_bitmask(m, mask, 0)
            return 0.0, compile_s, any(_allowed(mask[0], t) for t in control)
        mask, seconds = lt.allocate_token_bitmask(batch, vocab), 0.0
        for _ in range(steps):
            t0 = time.perf_counter()
            for i, m in enumerate(matchers):
                if not m.is_stopped():
                    lt.fill_next_token_bitmask(m, mask, i)
            seconds += time.perf_counter() - t0
            for i, m in enumerate(matchers):
                if not m.is_stopped():
                    m.consume_token(rng.choice(_allowed_tokens(mask[i], vocab)))
        return 1e6 * seconds / (steps * batch), compile_s, None

    return walk


def _xgrammar(tokenizer, vocab: int):
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    start = time.perf_counter()
    compiled = xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(json.dumps(SCHEMA),
                                                                                  any_whitespace=False)
    compile_s = time.perf_counter() - start
    control = _control_tokens(tokenizer, vocab)

    def walk(batch: int, steps: int, rng: random.Random | None):
        matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
        if rng is None:
            m = matchers[0]
            for t in tokenizer.encode('{"mayor": "ab', add_special_tokens=False):
                m.accept_token(t)
            mask = xgr.allocate_token_bitmask(1, vocab)
            m.fill_next_token_bitmask(mask, 0)
            return 0.0, compile_s, any(_allowed(mask[0], t) for t in control)
        mask, seconds = xgr.allocate_token_bitmask(batch, vocab), 0.0
        for _ in range(steps):
            t0 = time.perf_counter()
            for i, m in enumerate(matchers):
                if not m.is_terminated():
                    m.fill_next_token_bitmask(mask, i)
            seconds += time.perf_counter() - t0
            for i, m in enumerate(matchers):
                if not m.is_terminated():
                    m.accept_token(rng.choice(_allowed_tokens(mask[i], vocab)))
        return 1e6 * seconds / (steps * batch), compile_s, None

    return walk


def _allowed(row, token: int) -> bool:
    return bool((int(row[token // 32]) >> (token % 32)) & 1)


def _allowed_tokens(row, vocab: int) -> list[int]:
    import torch

    bits = ((row[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).bool().view(-1)[:vocab]
    return bits.nonzero().flatten().tolist()


_LIBRARIES = {"llguidance": _llguidance, "xgrammar": _xgrammar}
