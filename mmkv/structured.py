"""Structured output: a request's tokens kept inside a JSON schema, any JSON object, a list of
choices, a regular expression or a Lark grammar, on llguidance's token masks.

Why llguidance: it and xgrammar are the libraries vLLM, SGLang and llama.cpp build on, and both
were measured on this project's 2-core CPU (docs/structured-output.md). xgrammar filled a mask in
1-6 µs a token against llguidance's 20-45 µs, but with a string's ``maxLength`` it let raw control
characters (bytes 0x00-0x1f) into JSON strings, so its output failed ``json.loads``; llguidance
kept every output valid JSON. mmkv writes no grammar engine of its own: it compiles, keeps a
matcher per sequence, and applies the masks.

* ``StructuredOutput`` (``mmkv.sampling_params``) says what a request must produce.
* ``GrammarCache`` compiles it for one tokenizer, on the thread that prepares the request (never
  the engine's), keeping compiled grammars by their spec; a spec llguidance refuses raises
  ``ValueError`` naming the problem.
* ``Constraint`` is one sequence's matcher: it accepts the tokens the sequence appends.
  ``apply_masks`` fills every constrained row's mask (in parallel, off the GIL) and applies them
  and ``logit_bias`` to the step's logits in one batched operation, before any sampling filter.

Invariant: a constrained sequence only ever appends tokens its matcher accepts (its mask allows no
other), and its end-of-sequence token only where the grammar may end; it finishes when the grammar
can take no further token (a model without an end-of-sequence token ends there).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import torch

from mmkv.sampling_params import StructuredOutput

GRAMMARS_KEPT = 256  # compiled grammars a cache keeps (by spec, least recently used out)


class GrammarCache:
    """Compiled grammars of one tokenizer, by spec. Guarantees: ``compile`` returns the grammar
    of the spec (compiled and checked once per spec while it stays among the ``GRAMMARS_KEPT``
    most recently used), or raises ``ValueError`` saying what is wrong with it; it is safe from
    any thread."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llguidance = llguidance
        self.vocab_size = vocab_size
        # a model without an end-of-sequence token still needs one named: its last token, which
        # the masks allow only where the grammar may end and could go on (an open-ended pattern)
        eos = stop_token_ids or [vocab_size - 1]
        try:
            self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, vocab_size, eos_token=eos)
        except ValueError:  # a tokenizer llguidance cannot read: each token's text, as decoded
            self.tokenizer = llguidance.LLTokenizer(
                llguidance.TokenizerWrapper(_DecodedVocabulary(tokenizer, vocab_size, eos[0])),
                n_vocab=vocab_size, eos_token=eos)
        self.executor = llguidance.LLExecutor()
        self._grammars: OrderedDict[tuple, str] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutput) -> str:
        key = spec.key()
        with self._lock:
            if key in self._grammars:
                self._grammars.move_to_end(key)
                return self._grammars[key]
        grammar = self._compile(spec)
        with self._lock:
            self._grammars[key] = grammar
            while len(self._grammars) > GRAMMARS_KEPT:
                self._grammars.popitem(last=False)
        return grammar

    def _compile(self, spec: StructuredOutput) -> str:
        matcher = self.llguidance.LLMatcher
        kind = next(name for name in ("json_schema", "json_object", "choice", "regex", "grammar")
                    if getattr(spec, name) not in (None, False))
        try:
            if spec.json_schema is not None or spec.json_object:
                schema = spec.json_schema if spec.json_schema is not None else {"type": "object"}
                if isinstance(schema, str):
                    schema = json.loads(schema)
                if not isinstance(schema, dict):
                    raise ValueError("a JSON schema must be a JSON object")
                grammar = matcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
            elif spec.choice is not None:
                alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
                grammar = matcher.grammar_from_lark(f"start: {alternatives}")
            elif spec.regex is not None:
                grammar = matcher.grammar_from_regex(spec.regex)
            else:
                grammar = matcher.grammar_from_lark(spec.grammar)
        except (ValueError, TypeError) as err:
            raise ValueError(f"invalid {kind}: {_first_line(err)}") from None
        error = matcher.validate_grammar(grammar, self.tokenizer)
        if error and not error.startswith("WARNING"):
            raise ValueError(f"invalid {kind}: {_first_line(error)}")
        return grammar

    def constraint(self, grammar: str) -> Constraint:
        """A fresh matcher of a compiled ``grammar``."""
        return Constraint(self.llguidance.LLMatcher(self.tokenizer, grammar), self)


class Constraint:
    """One sequence's grammar state."""

    def __init__(self, matcher, grammars: GrammarCache) -> None:
        self.matcher = matcher
        self.grammars = grammars

    def accept(self, token: int) -> None:
        """Advance past ``token``; ``ValueError`` if the grammar does not allow it."""
        if not self.matcher.consume_token(token):
            raise ValueError(f"token {token} is not allowed by the request's structured output: "
                             f"{_first_line(self.matcher.get_error())}")

    @property
    def finished(self) -> bool:
        """Whether the grammar can take no further token."""
        return self.matcher.is_stopped()

    def fork(self) -> Constraint:
        """An independent copy in the same state (a sample of ``n > 1`` forks from its parent)."""
        return Constraint(self.matcher.deep_copy(), self.grammars)


class _DecodedVocabulary:
    """A tokenizer as llguidance's ``TokenizerWrapper`` reads one: every token's bytes (its text
    as the tokenizer decodes it alone) and how to encode text."""

    def __init__(self, tokenizer, vocab_size: int, eos: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id, self.bos_token_id, self.special_token_ids = eos, None, []
        known = len(tokenizer)
        self.tokens = [tokenizer.decode([i]).encode() if i < known else b"" for i in range(vocab_size)]

    def __call__(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)


def apply_masks(logits: torch.Tensor, rows: list[int], constraints: list[Constraint | None],
                biases: list[dict[int, float] | None]) -> None:
    """In place, for each ``rows[i]`` of ``logits [rows, vocab]``: add ``biases[i]`` and set every
    token its constraint does not allow to ``-inf``, all rows at once."""
    if any(biases):
        index = [(row, token, value) for row, bias in zip(rows, biases) if bias for token, value in bias.items()]
        r, t, v = zip(*index)
        logits.index_put_((torch.tensor(r), torch.tensor(t)),
                          torch.tensor(v, dtype=logits.dtype, device=logits.device), accumulate=True)
    masked = [(row, c) for row, c in zip(rows, constraints) if c is not None]
    if not masked:
        return
    grammars = masked[0][1].grammars
    vocab = logits.shape[-1]
    bitmask = torch.zeros((len(masked), -(-grammars.vocab_size // 32)), dtype=torch.int32)
    grammars.llguidance.torch.fill_next_token_bitmask_par(
        grammars.executor, [(c.matcher, i) for i, (_, c) in enumerate(masked)], bitmask)
    bits = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> bits) & 1).bool().view(len(masked), -1)[:, :vocab]
    if allowed.shape[1] < vocab:  # logits past the tokenizer's vocabulary: never allowed
        allowed = torch.cat([allowed, allowed.new_zeros(len(masked), vocab - allowed.shape[1])], 1)
    target = torch.tensor([row for row, _ in masked], device=logits.device)
    logits[target] = logits[target].masked_fill(~allowed.to(logits.device), float("-inf"))


def _first_line(err: BaseException | str) -> str:
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0][:300]
