"""Timing a speculating engine's passes before its first request.

So that the draft-length controller prices its first decision from what the passes cost on this
machine (and explores only where a draft that is always right would pay:
``speculative.controller``), the engine decodes made-up prompts at each batch size of
``CALIBRATION_BATCHES`` up to ``max_num_seqs`` (and as far as half the pool holds): prompts of 16
to ``CALIBRATION_PROMPT`` ordinary tokens, every step's draft length given by a script
(``CALIBRATION_LENGTHS``, 0 a plain step) and every draft a fixed token, so every kind of pass
runs whatever the draft would have proposed. The requests are dropped once the script is done;
their own cache namespace keeps them from sharing blocks with any request.

The engine then forgets the calibration but the pass costs (``Engine``).
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Protocol

from mmkv.sampling_params import SamplingParams

if TYPE_CHECKING:
    from cache import KVCache
    from mmkv.models import ModelAdapter
    from speculative.proposers import Speculator

CALIBRATION_BATCHES = (1, 8, 32)  # batch sizes the engine times its passes at
CALIBRATION_LENGTHS = (0, 1, 0, 3, 0, 8) * 2  # each calibration step's draft length (0: plain)
CALIBRATION_PROMPT = 512  # its made-up prompts run 16 tokens to this many (the contexts' spread)
CALIBRATION_SALT = "mmkv-calibration"  # the calibration's prompts share no cache with requests


class Calibrated(Protocol):
    """What the calibration drives: a speculating engine's requests and steps, and what bounds
    its made-up requests."""

    model: ModelAdapter
    kv: KVCache
    max_model_len: int

    @property
    def speculator(self) -> Speculator: ...

    @property
    def eos_token_ids(self) -> set[int]: ...

    @property
    def max_num_seqs(self) -> int: ...

    def add_request(self, prompt: list[int], params: SamplingParams, cache_salt: str) -> int: ...

    def step(self) -> list: ...

    def has_unfinished(self) -> bool: ...

    def abort(self, request_id: int) -> bool: ...


def calibrate(engine: Calibrated) -> None:
    """Run the calibration's requests through ``engine`` and drop them."""
    spec, rng = engine.speculator, random.Random(0)
    model = engine.model
    special = engine.eos_token_ids | {model.image_token_id}
    vocab = min(model.text_config.vocab_size, len(model.text_model.embed_tokens.weight))
    ordinary = [t for t in range(vocab) if t not in special]  # the draft model's vocabulary too
    tail = len(CALIBRATION_LENGTHS) + max(CALIBRATION_LENGTHS) + 2
    longest = min(CALIBRATION_PROMPT, engine.max_model_len - tail)
    blocks = -(-(longest + tail) // engine.kv.block_size)
    batches = [b for b in CALIBRATION_BATCHES
               if b <= engine.max_num_seqs and b * blocks <= engine.kv.pool.num_blocks // 2]
    if longest < 16 or not batches:
        return
    spec.propose_with(lambda seq, depth: ordinary[0])
    # room for every scripted length at every step (a round's limit is the tokens left, less 1)
    params = SamplingParams(max_tokens=tail - 1, ignore_eos=True)
    for batch in batches:
        spec.controller.follow_script(CALIBRATION_LENGTHS)
        ids = [engine.add_request([rng.choice(ordinary) for _ in range(rng.randint(16, longest))],
                                  params, cache_salt=CALIBRATION_SALT) for _ in range(batch)]
        while spec.controller.scripted and engine.has_unfinished():
            engine.step()
        for request_id in ids:  # done once the script is: the rest would be the controller's
            engine.abort(request_id)
    spec.propose_with(None)
