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
  the engine's), keeping each spec's compiled grammar and a matcher of it that each sequence
  of the spec copies; a spec llguidance refuses raises
  ``ValueError`` naming the problem.
* ``Constraint`` is one sequence's matcher: it accepts the tokens the sequence appends.
  ``apply_masks`` fills the masks of a step's constrained rows after its forward pass, one
  matcher after another, and applies them and ``logit_bias`` to the step's logits in one batched
  operation, before any sampling filter; ``apply_draft_masks`` does it for a speculative round's
  rows. (Filling the masks on a thread of their own while the forward pass ran was measured
  slower on a 2-core CPU, 0.86–0.88× of unconstrained decoding at batch 32 against 0.876–0.895×:
  the forward pass already keeps every core busy; so was llguidance's parallel executor.)

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
    most recently used), or raises ``ValueError`` saying what is wrong with it; ``constraint``
    returns a matcher at the grammar's start that no other sequence shares; both are safe from
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
        # by spec: its compiled grammar and a matcher of it at its start, never used but copied
        self._grammars: OrderedDict[tuple, tuple[str, object]] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutput) -> str:
        return self._entry(spec)[0]

    def constraint(self, spec: StructuredOutput) -> Constraint:
        """A fresh matcher of ``spec``: a copy of the one kept for it (building a matcher parses
        the grammar and builds its lexer, about 300 µs on the bundled model's schema; copying
        one, 0.5 µs)."""
        return Constraint(self._entry(spec)[1].deep_copy(), self)

    def _entry(self, spec: StructuredOutput) -> tuple[str, object]:
        key = spec.key()
        with self._lock:
            if key in self._grammars:
                self._grammars.move_to_end(key)
                return self._grammars[key]
        grammar = self._compile(spec)
        entry = grammar, self.llguidance.LLMatcher(self.tokenizer, grammar)
        with self._lock:
            self._grammars[key] = entry
            while len(self._grammars) > GRAMMARS_KEPT:
                self._grammars.popitem(last=False)
        return entry

    def _compile(self, spec: StructuredOutput) -> str:
        matcher, kind = self.llguidance.LLMatcher, spec.kind
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

    def bitmask(self, rows: int) -> torch.Tensor:
        """An empty mask of ``rows`` rows (int32, 32 tokens a word)."""
        return torch.zeros((rows, -(-self.vocab_size // 32)), dtype=torch.int32)



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
    """In place, for each ``rows[i]`` of ``logits [rows, vocab]``: add ``biases[i]`` and, where
    ``constraints[i]`` is a matcher, set every token it does not allow next to ``-inf``, all rows
    at once. The matchers are read, not moved."""
    _add_biases(logits, rows, biases)
    live = [(row, c) for row, c in zip(rows, constraints) if c is not None]
    if live:
        _mask_rows(logits, [row for row, _ in live], _fill([c for _, c in live]))


def _fill(constraints: list[Constraint]) -> torch.Tensor:
    """The next-token masks of ``constraints``, a row each."""
    grammars = constraints[0].grammars
    bitmask = grammars.bitmask(len(constraints))
    fill = grammars.llguidance.torch.fill_next_token_bitmask
    for i, constraint in enumerate(constraints):
        fill(constraint.matcher, bitmask, i)
    return bitmask


def apply_draft_masks(logits: torch.Tensor, start: int, constraint: Constraint | None,
                      bias: dict[int, float] | None, drafts: list[int]) -> None:
    """In place, for a speculative round's rows ``start .. start + len(drafts)`` of ``logits``
    (row ``j`` predicts the token after the ``j``-th draft): add ``bias`` to each, and mask each
    with what the grammar allows after the drafts before it. Past a draft the grammar refuses,
    rows allow everything: verification rejects that draft (its row's mask forbids it), so no
    later row is read. The matcher ends where it began."""
    rows = list(range(start, start + len(drafts) + 1))
    _add_biases(logits, rows, [bias] * len(rows))
    if constraint is None:
        return
    grammars, matcher = constraint.grammars, constraint.matcher
    bitmask = grammars.bitmask(len(rows))
    consumed = 0
    for j in range(len(rows)):
        grammars.llguidance.torch.fill_next_token_bitmask(matcher, bitmask, j)
        if j == len(drafts):
            break
        token = drafts[j]  # consumed only if allowed: a refused token would leave the matcher in error
        if not (int(bitmask[j, token // 32]) >> (token % 32)) & 1 or not matcher.consume_token(token):
            bitmask[j + 1:] = -1  # every bit set
            break
        consumed += 1
    if consumed and not matcher.rollback(consumed):
        raise RuntimeError("the grammar matcher could not roll back a round's drafts")
    _mask_rows(logits, rows, bitmask)


def _add_biases(logits: torch.Tensor, rows: list[int], biases: list[dict[int, float] | None]) -> None:
    index = [(row, token, value) for row, bias in zip(rows, biases) if bias for token, value in bias.items()]
    if index:
        r, t, v = zip(*index)
        logits.index_put_((torch.tensor(r), torch.tensor(t)),
                          torch.tensor(v, dtype=logits.dtype, device=logits.device), accumulate=True)


def _mask_rows(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """``-inf`` at every token a row's bits (32 tokens a word, lowest bit first) leave out;
    tokens past the grammar's vocabulary are never allowed. Each byte of the mask is looked up
    as its 8 tokens' penalties (0 or ``-inf``) and the penalties are added to the rows: on the
    CPU a lookup and an add cost a tenth of expanding the bits and ``masked_fill_`` (17 against
    155 µs for 32 rows of 1,024 tokens; ``masked_fill_`` with a bool mask runs element by
    element)."""
    vocab = logits.shape[-1]
    penalty = torch.nn.functional.embedding(bitmask.view(torch.uint8).long(), _BYTE_PENALTIES).view(len(rows), -1)
    if penalty.shape[1] >= vocab:
        penalty = penalty[:, :vocab]
    else:
        penalty = torch.cat([penalty, penalty.new_full((len(rows), vocab - penalty.shape[1]), float("-inf"))], 1)
    penalty = penalty.to(logits.device, logits.dtype)
    if rows == list(range(rows[0], rows[0] + len(rows))):  # consecutive rows: a view, in place
        logits[rows[0]:rows[0] + len(rows)].add_(penalty)
    else:
        logits.index_add_(0, torch.tensor(rows, device=logits.device), penalty)


# a mask byte's 8 tokens, lowest bit first: 0 where allowed, -inf where not (the int32 words are
# read as bytes in memory order, lowest first: little-endian, as every CPU torch runs on here is)
_BYTE_PENALTIES = torch.where((torch.arange(256)[:, None] >> torch.arange(8)) & 1 == 1, 0.0, float("-inf"))


def _first_line(err: BaseException | str) -> str:
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0][:300]
