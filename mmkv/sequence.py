"""The state of one sequence (one sample of one request) inside the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np
import torch

from cache import BlockTable, SwappedTable, make_keys
from mmkv.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # no KV on the device; (re)prefills when admitted
    RUNNING = "running"
    SWAPPED = "swapped"  # KV parked in the host tier
    FINISHED = "finished"


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
    status: Status = Status.WAITING
    table: BlockTable | None = None
    swapped: SwappedTable | None = None
    num_computed: int = 0
    num_cached_blocks: int = 0  # full blocks of ``table`` already inserted into the radix tree
    admitted: bool = False  # has been admitted at least once (a recomputed one is re-admitted)
    cached_tokens: int = 0  # prompt tokens served from the cache at first admission
    finish_reason: str | None = None
    text: str = ""
    _array: np.ndarray = field(default=None, repr=False)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

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
        """Radix-tree keys of the first ``n`` tokens (all by default)."""
        return make_keys(self.tokens_array()[:n])
