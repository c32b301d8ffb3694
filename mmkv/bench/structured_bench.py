"""Structured output's cost: tokens/s with and without a JSON schema on the bundled model.

The bundled model answers ``--requests`` report questions ("describe the town as json.") at batch
32 (all at once) and ``--batch1-requests`` of them one at a time, greedy, at most ``--max-tokens``
tokens each, constrained by a schema of four fields (a bounded string, a bounded integer, an enum
array, a boolean), and free, each request made to generate as many tokens as its constrained
answer had (so both make the same tokens from the same prompts). Per batch size: generated tokens per second of each (the
fastest of ``--repeats`` runs on fresh engines), their ratio
(``schema_vs_free_tokens_per_s_b1`` / ``_b32``), and the microseconds per constrained token a
step spent filling its masks and applying them (``mask_us_per_token_b1`` / ``_b32``).
``all_outputs_valid``: every constrained output parses as JSON and validates against the schema
(when one does not, ``python -m mmkv.bench`` exits non-zero, as when a bench's outputs differ
from its peer's).

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

from mmkv import SamplingParams, StructuredOutput, structured
from mmkv.bench import add_bundled_answer_arguments, serve_bundled
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
    add_bundled_answer_arguments(p)
    p.add_argument("--libraries", action="store_true", help="also time llguidance and xgrammar alone")


class _MaskClock:
    """Times every ``structured.apply_masks`` while it is installed: what a step spends filling
    its masks and applying them."""

    def __init__(self) -> None:
        self.seconds, self.original = 0.0, structured.apply_masks

    def __enter__(self) -> _MaskClock:
        clock, original = self, self.original

        def timed(*args) -> None:
            start = time.perf_counter()
            original(*args)
            clock.seconds += time.perf_counter() - start

        structured.apply_masks = timed
        return self

    def __exit__(self, *exc) -> None:
        structured.apply_masks = self.original


def _serve(prompts: list[str], batch: int, params: list[SamplingParams]) -> tuple[list, float, float]:
    """Outputs, seconds and mask seconds of ``prompts`` (each with its ``params``) served
    ``batch`` at a time on a fresh engine (``serve_bundled``)."""
    clock = _MaskClock()
    outs, seconds = serve_bundled(prompts, batch, params, lambda: clock)
    return outs, seconds, clock.seconds


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
            for library, adapter in (("llguidance", _LLGuidance), ("xgrammar", _XGrammar)):
                try:
                    lib = adapter(tokenizer, len(tokenizer))
                except ImportError:
                    out[f"{library}_{name}"] = "not installed (make bench-peers)"
                    continue
                out[f"{library}_{name}"] = {
                    **{f"fill_us_per_token_b{b}": round(_walk(lib, b, 40, random.Random(b)), 1) for b in (1, 32)},
                    "compile_seconds": round(lib.compile_seconds, 4),
                    "control_characters_in_strings": _admits_control_characters(lib, tokenizer)}
    return out


class _LLGuidance:
    """llguidance behind the few calls the timings make."""

    string_start = '{"mayor":"ab'  # its compact JSON: no space after the colon

    def __init__(self, tokenizer, vocab: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg, self.vocab = llguidance, vocab
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, vocab)
        start = time.perf_counter()
        self.grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
        llguidance.LLMatcher(self.tokenizer, self.grammar).compute_bitmask()
        self.compile_seconds = time.perf_counter() - start

    def matcher(self):
        return self.llg.LLMatcher(self.tokenizer, self.grammar)

    def bitmask(self, rows: int):
        return self.llg.torch.allocate_token_bitmask(rows, self.vocab)

    def fill(self, matcher, bitmask, row: int) -> None:
        self.llg.torch.fill_next_token_bitmask(matcher, bitmask, row)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def done(self, matcher) -> bool:
        return matcher.is_stopped()


class _XGrammar:
    """xgrammar behind the same calls."""

    string_start = '{"mayor": "ab'  # its JSON without free whitespace still puts a space there

    def __init__(self, tokenizer, vocab: int) -> None:
        import xgrammar

        self.xgr, self.vocab = xgrammar, vocab
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
        start = time.perf_counter()
        self.compiled = xgrammar.GrammarCompiler(info, cache_enabled=False).compile_json_schema(
            json.dumps(SCHEMA), any_whitespace=False)
        self.compile_seconds = time.perf_counter() - start

    def matcher(self):
        return self.xgr.GrammarMatcher(self.compiled)

    def bitmask(self, rows: int):
        return self.xgr.allocate_token_bitmask(rows, self.vocab)

    def fill(self, matcher, bitmask, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def done(self, matcher) -> bool:
        return matcher.is_terminated()


def _walk(lib, batch: int, steps: int, rng: random.Random) -> float:
    """Microseconds per mask fill over ``steps`` steps of ``batch`` random walks through the grammar."""
    matchers = [lib.matcher() for _ in range(batch)]
    bitmask, seconds = lib.bitmask(batch), 0.0
    for _ in range(steps):
        start = time.perf_counter()
        for i, m in enumerate(matchers):
            if not lib.done(m):
                lib.fill(m, bitmask, i)
        seconds += time.perf_counter() - start
        for i, m in enumerate(matchers):
            if not lib.done(m):
                lib.accept(m, rng.choice(_allowed_tokens(bitmask[i], lib.vocab)))
    return 1e6 * seconds / (steps * batch)


def _admits_control_characters(lib, tokenizer) -> bool:
    """Inside the mayor's string, may a token holding a byte below 0x20 come next?"""
    matcher = lib.matcher()
    for token in tokenizer.encode(lib.string_start, add_special_tokens=False):
        if not lib.accept(matcher, token):
            raise RuntimeError(f"{type(lib).__name__} refused {lib.string_start!r}")
    bitmask = lib.bitmask(1)
    lib.fill(matcher, bitmask, 0)
    allowed = set(_allowed_tokens(bitmask[0], lib.vocab))
    return any(any(ord(c) < 32 for c in tokenizer.decode([t])) for t in allowed)


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


def _allowed_tokens(row, vocab: int) -> list[int]:
    import torch

    bits = ((row[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).bool().view(-1)[:vocab]
    return bits.nonzero().flatten().tolist()


