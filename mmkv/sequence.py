"""The state of one sequence (one sample of one request) inside the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np
import torch

from cache import BlockTable, ImageSpan, SwappedTable, make_keys
from mmkv.detokenizer import IncrementalText
from mmkv.models import ImagePlacement, MRopePositions
from mmkv.outputs import Reuse, TokenLogprob
from mmkv.sampling_params import SamplingParams
from mmkv.structured import Constraint
from speculative.acceptance import DraftHistory
from vision import PreparedImage


class Status(enum.Enum):
    WAITING = "waiting"  # no KV on the device; (re)prefills when admitted
    RUNNING = "running"
    SWAPPED = "swapped"  # KV parked in the host tier
    FINISHED = "finished"


@dataclass(slots=True)
class SeqImage:
    """An image of a sequence: where its placeholder sits and how the model consumes it."""

    image: PreparedImage
    start: int  # index of its first token in the sequence
    placement: ImagePlacement
    visible_until: int | None = None  # cross-attention: positions from here on no longer see it

    @property
    def in_sequence(self) -> bool:
        """Whether its tokens carry the image (LLaVA) rather than just mark it (cross-attention)."""
        return self.placement.xattn_tokens == 0


@dataclass(slots=True)
class TokenCounts:
    """What a sequence's penalties count (``mmkv.penalties.counts`` brings it up to date)."""

    counted: int = 0  # the sequence's tokens counted so far (its tokens only ever grow)
    seen: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # distinct, sorted
    output: dict[int, int] = field(default_factory=dict)  # output token -> times generated


@dataclass(slots=True, eq=False)
class Sequence:
    """Tokens so far (prompt then output) and how many of them have KV in ``table``.

    Each step computes tokens ``[num_computed, len(token_ids))`` (possibly in chunks); when the
    last one is computed its logits give the next token. Decoding is the case of one token left.
    """

    seq_id: int
    request_id: int
    index: int  # sample index inside the request (n > 1)
    token_ids: list[int]
    prompt_len: int
    params: SamplingParams
    arrival: int
    namespace: bytes
    generator: torch.Generator | None
    stop_token_ids: frozenset[int] = frozenset()  # tokens that end it when generated
    fork_generators: list[torch.Generator | None] = field(default_factory=list)  # of samples 1..n-1
    status: Status = Status.WAITING
    table: BlockTable | None = None
    swapped: SwappedTable | None = None
    num_computed: int = 0
    num_cached_blocks: int = 0  # full blocks of ``table`` already inserted into the radix tree
    admitted: bool = False  # has been admitted at least once (a recomputed one is re-admitted)
    arrival_time: float | None = None  # the scheduler's clock when it was first queued
    preemptions: int = 0  # times it was preempted (swapped out or dropped to recompute)
    most_computed: int = 0  # the most tokens it has had K/V for: positions below are recomputed
    cached_tokens: int = 0  # prompt tokens served from the cache at first admission
    finish_reason: str | None = None
    text: str = ""  # the output's text cut at a stop string, when one ended it
    stop_text: IncrementalText | None = None  # the output's text as far as stop strings were sought
    images: list[SeqImage] = field(default_factory=list)
    image_tables: list[BlockTable] = field(default_factory=list)  # cross-attention K/V blocks
    rope: MRopePositions | None = None  # M-RoPE models: positions fixed at submission
    logprobs: list[TokenLogprob] | None = None  # one per output token, when asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token, when asked for
    constraint: Constraint | None = None  # its structured output's grammar state, when asked for
    reuse: Reuse = field(default_factory=Reuse)  # what its prompt took from the caches
    # the speculator's own record of this sequence (the runner's proposers keep them)
    drafting: DraftHistory | None = None  # its drafts' acceptance
    draft_valid: int | None = None  # a draft model's K/V is current below this (None: ask the cache)
    penalty_counts: TokenCounts | None = None  # what its penalties count (``mmkv.penalties``)
    _array: np.ndarray = field(default=None, repr=False)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def prompt_logprobs_pending(self) -> bool:
        """Whether prompt log-probabilities were asked for and some are not computed yet."""
        wanted = self.params.prompt_logprobs is not None
        return wanted and (self.prompt_logprobs is None or self.prompt_logprobs[-1] is None) and self.prompt_len > 1

    @property
    def num_generated(self) -> int:
        """``len(output_ids)`` without copying them (asked every step and every token)."""
        return len(self.token_ids) - self.prompt_len

    @property
    def num_pending(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def sort_key(self) -> tuple[int, int]:
        """Scheduling order: priority (lower first), then arrival."""
        return self.params.priority, self.arrival

    def tokens_array(self) -> np.ndarray:
        """The token ids as int64 (cached until tokens are appended)."""
        if self._array is None or self._array.shape[0] != len(self.token_ids):
            self._array = np.asarray(self.token_ids, dtype=np.int64)
        return self._array

    def keys(self, n: int | None = None) -> np.ndarray:
        """Radix-tree keys of the first ``n`` tokens (all by default); image tokens carry the
        image's uid and their offset in it."""
        return prompt_keys(self.tokens_array()[:n], self.images)


def prompt_keys(tokens: np.ndarray, images: list[SeqImage]) -> np.ndarray:
    """Radix-tree keys of ``tokens``; the tokens of an image in the prompt carry the image's uid
    and their offset in it."""
    spans = [ImageSpan(i.start, min(i.placement.prompt_tokens, len(tokens) - i.start), i.image.uid)
             for i in images if i.in_sequence and i.start < len(tokens)]
    return make_keys(tokens, spans)
