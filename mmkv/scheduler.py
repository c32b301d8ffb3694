"""Continuous batching over one ``KVCache``: which sequences compute how many tokens each step.

Order of work in a step, under a budget of ``max_num_batched_tokens``:

1. Running sequences, most important first (lowest ``priority``, then oldest): each gets its next
   chunk (one token when decoding, up to the remaining budget when prefilling; long prompts are
   prefilled in chunks). When the pool cannot hold a chunk, the running sequences are ranked by
   the preemption policy (``mmkv.preemption``: the lowest priority class first, within it the
   newest, the default, or the cheapest to preempt) and preempted in that order until the chunk fits, possibly
   the sequence itself; one scheduled earlier in the step leaves the batch. The cost, in seconds,
   is ``restore + wait * waited + progress * generated + repeat * preempted`` (``restore`` below;
   ``waited`` seconds since arrival; ``generated`` tokens; ``preempted`` times so far; the
   weights are ``CostWeights``).
2. Swapped sequences come back when their blocks fit, unless this step preempted.
3. Waiting sequences are admitted in order while their first chunk fits. A waiting sequence whose
   prompt shares at least a block more with a sequence still prefilling than the cache holds yet
   waits one step, so prompts submitted together compute their shared prefix once. One whose
   images must be encoded first stays waiting while a worker encodes them
   (``mmkv.encoder_queue``), and the sequences after it are admitted meanwhile. Encoding starts
   for the waiting sequences that may be admitted next, before admission; when none runs, the
   step first waits for those encodings (so an idle engine admits as if it encoded inline). A
   step left with nothing to run but encodings waits for one (at most ``ENCODER_WAIT`` seconds)
   and is empty.

4. Decoding sequences that may speculate (one sequence a request, no log-probabilities) get the
   draft length the draft-length controller chose for this step and that many more slots
   reserved, while the pool has them; when it chose 0 for all, they decode plainly.

Preemption either swaps the victim's private blocks to the host tier or drops them to recompute
later. ``preemption="auto"`` picks per victim the cheaper by its restore estimate
(``mmkv.preemption.restore_estimate``, priced with this machine's measured ``RestoreSpeeds``),
which the ``"cost"`` policy also ranks by. ``rebuild_flops(start, count)`` is the model's cost
of recomputing ``count`` tokens from position ``start``; it is also each cached block's cost for
the cost-based eviction policy.

Guarantees: a scheduled sequence has its slots reserved (its drafts' too); every step that has
work schedules some (a request that fits the pool alone fits once the others are preempted). Under
``"newest"`` the most important running sequence always progresses; under ``"cost"`` a sequence
becomes dearer with every preemption, so under a steady stream of arrivals none is preempted
without bound and a request that fits the pool alone finishes.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, NamedTuple

import numpy as np
import xxhash

from cache import BlockTable, KVCache, OutOfBlocksError
from mmkv.encoder_queue import EncoderQueue
from mmkv.preemption import POLICIES, CostWeights, Restore, RestoreSpeeds, rank_victims, restore_estimate
from mmkv.sequence import Sequence, Status

if TYPE_CHECKING:
    from vision import VisionPipeline
    from mmkv.image_kv import CrossAttentionKV

PREEMPTION_MODES = ("auto", "swap", "recompute")
ENCODER_WAIT = 0.05  # seconds a step with nothing else to run waits for an image's encoding


@dataclass(slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    preemption: str = "auto"
    enable_prefix_caching: bool = True
    preemption_policy: str = "newest"
    preemption_weights: CostWeights = field(default_factory=CostWeights)

    def __post_init__(self) -> None:
        if self.preemption not in PREEMPTION_MODES:
            raise ValueError(f"preemption must be one of {PREEMPTION_MODES}, got {self.preemption!r}")
        if self.preemption_policy not in POLICIES:
            raise ValueError(f"preemption_policy must be one of {POLICIES}, "
                             f"got {self.preemption_policy!r}")
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class ScheduledBatch(NamedTuple):
    """One step's work. A plain pass computes ``q_lens[i]`` new tokens of ``seqs[i]``; a
    speculative round drafts up to ``draft_lengths[i]`` tokens after the pending token of
    ``drafting[i]`` (0: it joins verification with its pending token alone) and verifies them.
    ``failed``: sequences whose admission raised (computing their images' K/V), out of every
    queue and holding nothing."""

    seqs: list[Sequence]
    q_lens: list[int]
    drafting: list[Sequence]
    draft_lengths: list[int]
    failed: list[tuple[Sequence, Exception]]

    def only_decodes(self) -> bool:
        """Whether every scheduled sequence computes just its pending token (before it runs)."""
        return all(s.num_computed == len(s.token_ids) - 1 for s in (*self.seqs, *self.drafting))


@dataclass(slots=True)
class PreemptionStats:
    recompute: int = 0  # preemptions that dropped the victim's K/V to recompute
    swap: int = 0  # preemptions that swapped it to the host tier
    swapped_bytes: int = 0
    recomputed_tokens: int = 0  # tokens computed again at positions a sequence had computed before
    most_per_request: int = 0  # the most times one sequence was preempted


class PrefillingBlocks:
    """The next full block each sequence still prefilling computes, found by the digest of the
    keys up to and including it: a waiting sequence whose prompt starts with such a prefix waits
    a step and then reads that block from the cache (rule 3 of the module docstring).

    A sequence that has computed ``c`` tokens of keys ``k`` computes block ``c // block_size``
    next; it is indexed under ``n = (c // block_size + 1) * block_size`` and the digest of
    ``k[:n]`` when ``n`` is below ``len(k)`` (a sequence's last token is never read from the
    cache). Another sequence of keys ``m`` in the same namespace waits exactly when, for one such
    entry, ``n < len(m)`` and ``m[:n] == k[:n]``: its prompt holds that block and its cache lookup
    could reuse it. Digests only find candidates; a candidate is confirmed by comparing keys.
    A waiting sequence costs one digest per distinct ``n`` indexed (mostly one or two), not a
    comparison with every sequence prefilling."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.by_length: dict[int, dict[tuple[str | None, int], list[np.ndarray]]] = {}

    def __bool__(self) -> bool:
        return bool(self.by_length)

    def add(self, keys: np.ndarray, namespace: str | None, num_computed: int) -> None:
        n = (num_computed // self.block_size + 1) * self.block_size
        if n < len(keys):
            self.by_length.setdefault(n, {}).setdefault((namespace, _digest(keys[:n])), []).append(keys)

    def computes_more_of(self, keys: np.ndarray, namespace: str | None) -> bool:
        for n, entries in self.by_length.items():
            if n < len(keys):
                for theirs in entries.get((namespace, _digest(keys[:n])), ()):
                    if np.array_equal(theirs[:n], keys[:n]):
                        return True
        return False


def _digest(keys: np.ndarray) -> int:
    return xxhash.xxh3_64_intdigest(np.ascontiguousarray(keys))


def plan_drafts(batch: ScheduledBatch, kv: KVCache,
                draft_lengths: Callable[[list[Sequence], bool], list[int]]) -> ScheduledBatch:
    """Move the decoding sequences of ``batch`` that may speculate to the round with the draft
    lengths ``draft_lengths`` chose, each with its drafts' slots reserved (a draft the pool has no
    room for becomes 0); when it chose 0 for all, they decode in the plain pass, after the others."""
    seqs, q_lens, candidates = [], [], []
    for seq, q in zip(batch.seqs, batch.q_lens):
        if q == 1 and seq.num_pending == 1 and seq.params.n == 1 and seq.params.logprobs is None:
            candidates.append(seq)
        else:
            seqs.append(seq)
            q_lens.append(q)
    if not candidates:
        return batch
    lengths = draft_lengths(candidates, bool(seqs))
    if not any(lengths):
        return ScheduledBatch(seqs + candidates, q_lens + [1] * len(candidates), [], [], batch.failed)
    reserved = []
    for seq, gamma in zip(candidates, lengths):
        if gamma and kv.blocks_needed(seq.table, gamma) <= kv.num_available():
            kv.append_slots(seq.table, gamma)
        else:
            gamma = 0
        reserved.append(gamma)
    return ScheduledBatch(seqs, q_lens, candidates, reserved, batch.failed)


def count_reuse(seq: Sequence, cached: int) -> None:
    """At first admission: what the prompt took from the caches (``Sequence.reuse``; the encoder
    queue counted ``images_encoded`` before admitting it)."""
    reuse = seq.reuse
    reuse.images = len(seq.images)
    reuse.prompt_tokens_computed = len(seq.token_ids) - cached
    held = sum(len(t.blocks) for t in seq.image_tables)
    reuse.xattn_blocks_reused = max(0, held - reuse.xattn_blocks_computed)


def swap_or_drop(seq: Sequence, kv: KVCache, how: str, stats: PreemptionStats) -> bool:
    """Preempt ``seq`` (its table holding only its computed tokens): ``how == "swap"`` moves its
    table to the host tier (True), else its blocks are freed and it starts again from its first
    token (False). Counted in ``stats``."""
    seq.preemptions += 1
    stats.most_per_request = max(stats.most_per_request, seq.preemptions)
    if how == "swap":
        seq.swapped, seq.table = kv.swap_out(seq.table), None
        stats.swap += 1
        stats.swapped_bytes += len(seq.swapped.host_slots) * kv.bytes_per_block
        return True
    kv.free(seq.table)
    seq.table, seq.num_computed, seq.num_cached_blocks = None, 0, 0
    stats.recompute += 1
    return False


class Scheduler:
    """Decides each step's batch and keeps sequences' block tables in step with the cache.

    ``image_kv`` holds cross-attention models' image K/V (admitting a sequence acquires its
    images'); ``draft_lengths`` is the draft-length controller of a speculating engine: for the
    decoding sequences that may speculate, and whether the step also carries prompt chunks, how
    many tokens each drafts this step."""

    def __init__(self, kv: KVCache, config: SchedulerConfig,
                 rebuild_flops: Callable[[int, int], float], speeds: RestoreSpeeds,
                 image_kv: CrossAttentionKV | None = None,
                 draft_lengths: Callable[[list[Sequence], bool], list[int]] | None = None,
                 clock: Callable[[], float] | None = None, vision: VisionPipeline | None = None) -> None:
        self.kv = kv
        self.encodes = EncoderQueue(vision, kv, image_kv, config.enable_prefix_caching)
        self.clock = clock or time.monotonic  # seconds, for how long a request has waited
        self.config = config
        self.rebuild_flops = rebuild_flops
        self.speeds = speeds  # this machine's, for the restore estimate
        self.image_kv = image_kv
        self.draft_lengths = draft_lengths
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.preemptions = PreemptionStats()
        self.cached_prompt_tokens = 0  # prompt tokens served from the cache at first admission
        self.peak_blocks_in_use = 0  # the most blocks a step has held, its drafts' slots included
        self._failures: list[tuple[Sequence, Exception]] = []  # raised while being admitted

    def add(self, seq: Sequence) -> None:
        if seq.arrival_time is None:
            seq.arrival_time = self.clock()
        seq.status = Status.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def add_running(self, seq: Sequence) -> None:
        """A sequence that runs from now on, its table already holding its K/V (a sample forked
        from a running one)."""
        seq.status = Status.RUNNING
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def stats(self) -> dict[str, int]:
        """Requests running and waiting (or swapped out), prompt tokens served from the cache,
        preemptions by kind, bytes swapped out, tokens recomputed, the most preemptions of one
        sequence, and the peak of blocks in use."""
        running = {s.request_id for s in self.running}
        waiting = {s.request_id for s in (*self.waiting, *self.swapped)} - running
        pre = self.preemptions
        return {"requests_running": len(running), "requests_waiting": len(waiting),
                "cached_prompt_tokens": self.cached_prompt_tokens,
                "preemptions_recompute": pre.recompute, "preemptions_swap": pre.swap,
                "swapped_bytes": pre.swapped_bytes, "recomputed_tokens": pre.recomputed_tokens,
                "max_preemptions_per_request": pre.most_per_request,
                "peak_blocks_in_use": self.peak_blocks_in_use}

    # -- the step -------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        """This step's batch. Raises ``RuntimeError`` when there is work but none of it could be
        scheduled (a bug: a request that fits the pool alone always progresses)."""
        budget = self.config.max_num_batched_tokens
        batch = ScheduledBatch([], [], [], [], [])
        preemptions_before = self.preemptions.recompute + self.preemptions.swap
        self.running.sort(key=lambda s: s.sort_key)
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.status is not Status.RUNNING:
                continue  # preempted this step to make room for another
            n = min(seq.num_pending, budget)
            if self._reserve_preempting(seq, n, batch):
                batch.seqs.append(seq)
                batch.q_lens.append(n)
            budget = self.config.max_num_batched_tokens - sum(batch.q_lens)
        if self.preemptions.recompute + self.preemptions.swap == preemptions_before:
            budget = self._resume_swapped(batch, budget)
            if not self.swapped:
                room = self.config.max_num_seqs - len(self.running)
                self.encodes.prefetch(self.waiting[:room], wait=not self.running)
                self._admit_waiting(batch, budget)
        failed, self._failures = self._failures, []
        if not batch.seqs and not failed and self.has_work() and not self.encodes.wait(ENCODER_WAIT):
            raise RuntimeError("the scheduler could not schedule any work")
        batch = batch._replace(failed=failed)
        if self.draft_lengths is not None:
            batch = plan_drafts(batch, self.kv, self.draft_lengths)
        self.peak_blocks_in_use = max(self.peak_blocks_in_use, self.kv.pool.num_in_use)
        return batch

    def _reserve_preempting(self, seq: Sequence, n: int, batch: ScheduledBatch) -> bool:
        """Reserve ``n`` slots for ``seq``, preempting running sequences in the policy's order as
        needed (one this step scheduled already leaves the batch). False when ``seq`` itself was
        preempted."""
        victims = None
        while True:
            try:
                self.kv.append_slots(seq.table, n)
                return True
            except OutOfBlocksError:
                if victims is None:  # ranked once, when the pool first runs short
                    victims = iter(rank_victims(list(self.running), self.config.preemption_policy,
                                                self.config.preemption_weights,
                                                lambda s: self._restore(s).seconds,
                                                self.clock()))
                victim = next(victims)
                if victim in batch.seqs:
                    at = batch.seqs.index(victim)
                    del batch.seqs[at], batch.q_lens[at]
                self.running.remove(victim)
                self._preempt(victim)
                if victim is seq:
                    return False

    def _resume_swapped(self, batch: ScheduledBatch, budget: int) -> int:
        self.swapped.sort(key=lambda s: s.sort_key)
        while self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.swapped[0]
            n = min(seq.num_pending, budget)
            need = len(seq.swapped.host_slots) + -(-n // self.kv.block_size) + 1
            if need > self.kv.num_available():
                break
            acquired = self._acquire_images(seq)
            if acquired is None and seq not in self.swapped:
                continue  # it failed and left the queue
            if not acquired:
                break
            if need > self.kv.num_available():  # the images took the room
                self._release_images(seq)
                break
            self.swapped.pop(0)
            seq.table, seq.swapped = self.kv.swap_in(seq.swapped), None
            seq.num_cached_blocks = 0  # re-inserting dedupes the copies against the tree
            self.kv.append_slots(seq.table, n)
            self._run(seq, batch, n)
            budget -= n
        return budget

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        prefilling = PrefillingBlocks(self.kv.block_size)
        if self.config.enable_prefix_caching:
            for seq in self.running:
                if seq.num_pending > 1:
                    prefilling.add(seq.keys(), seq.namespace, seq.num_computed)
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                return
            if prefilling and prefilling.computes_more_of(seq.keys(), seq.namespace):
                continue
            acquired = self._acquire_images(seq)
            if acquired is None:
                continue
            if not acquired:
                return
            table = self._acquire(seq)
            cached = table.num_tokens
            if self.image_kv is None and not self._images_ready(seq, cached):
                self.kv.free(table)
                self._release_images(seq)
                continue
            n = min(len(seq.token_ids) - cached, budget)
            try:
                if self.kv.blocks_needed(table, n) > self.kv.num_available():
                    raise OutOfBlocksError("first chunk does not fit")
                self.kv.append_slots(table, n)
            except OutOfBlocksError:
                self.kv.free(table)
                self._release_images(seq)
                return
            self.waiting.remove(seq)
            if not seq.admitted:
                seq.admitted, seq.cached_tokens = True, cached
                self.cached_prompt_tokens += cached
                count_reuse(seq, cached)
            seq.table, seq.num_computed = table, cached
            seq.num_cached_blocks = cached // self.kv.block_size
            seq.draft_valid = None  # a new table: a draft model reads what its blocks hold
            self._run(seq, batch, n)
            if self.config.enable_prefix_caching:
                prefilling.add(seq.keys(), seq.namespace, cached)
            budget -= n

    def _acquire(self, seq: Sequence) -> BlockTable:
        if not self.config.enable_prefix_caching or seq.prompt_logprobs_pending:
            return BlockTable()  # a cached token would have no logits to score it
        # The last token is always computed: its logits choose the next token.
        return self.kv.acquire_prefix(seq.keys(len(seq.token_ids) - 1), seq.namespace)

    def _run(self, seq: Sequence, batch: ScheduledBatch, n: int) -> None:
        seq.status = Status.RUNNING
        self.running.append(seq)
        batch.seqs.append(seq)
        batch.q_lens.append(n)

    # -- after the step -------------------------------------------------------------------------
    def commit(self, seq: Sequence, n: int) -> None:
        """``n`` more tokens of ``seq`` have KV now; cache its newly completed full blocks."""
        self.preemptions.recomputed_tokens += max(0, min(seq.num_computed + n, seq.most_computed)
                                                  - seq.num_computed)
        seq.num_computed += n
        seq.most_computed = max(seq.most_computed, seq.num_computed)
        bs = self.kv.block_size
        full = seq.num_computed // bs
        new = full - seq.num_cached_blocks
        if self.config.enable_prefix_caching and new > 0:
            cost = self.rebuild_flops(seq.num_cached_blocks * bs, new * bs) / new
            own = seq.table.blocks[:full]
            self.kv.cache_prefix(seq.table, seq.keys(full * bs), seq.namespace, cost)
            seq.num_cached_blocks = full
            if seq.table.blocks[:full] != own:  # blocks the tree held already: a draft model
                seq.draft_valid = None  # reads what they hold, not what its own copies held

    def finish(self, seq: Sequence) -> None:
        """Release a finished sequence; its full blocks stay cached for later requests."""
        if seq in self.running:
            self.running.remove(seq)
        self._release(seq)
        seq.status = Status.FINISHED

    def _acquire_images(self, seq: Sequence) -> bool | None:
        """Whether the images' K/V are held now; None when their encoder outputs are not ready, or
        when encoding or computing them raised (it then left its queue for the batch's ``failed``)."""
        try:
            if self.image_kv is None or not seq.images:
                return True
            return self.image_kv.acquire(seq) if self.encodes.ready(seq) else None
        except Exception as err:
            self._fail(seq, err)
            return None

    def _images_ready(self, seq: Sequence, cached: int) -> bool:
        """Whether the encoder outputs the prefill of ``seq`` from token ``cached`` reads are held
        for it; False too when encoding one raised (it then left its queue for the batch's
        ``failed``)."""
        try:
            return self.encodes.ready(seq, cached)
        except Exception as err:
            self._fail(seq, err)
            return False

    def _fail(self, seq: Sequence, err: Exception) -> None:
        self._release(seq)
        self._failures.append((seq, err))

    def _release_images(self, seq: Sequence) -> None:
        if self.image_kv is not None:
            self.image_kv.release(seq)

    def _release(self, seq: Sequence) -> None:
        self._release_images(seq)
        self.encodes.release(seq)
        if seq.table is not None:
            self.kv.free(seq.table)
            seq.table = None
        if seq.swapped is not None:
            self.kv.drop_swapped(seq.swapped)
            seq.swapped = None
        if seq in self.swapped:
            self.swapped.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)

    def check_integrity(self) -> None:
        """Between steps: a running sequence's table holds exactly its computed tokens (no slot of
        a rejected draft, no chunk reserved and not run) in as many blocks as they fill; a waiting
        sequence holds no table; a swapped one only its table in the host tier."""
        bs = self.kv.block_size
        for seq in self.running:
            table = seq.table
            assert table is not None and table.num_tokens == seq.num_computed, (
                f"sequence {seq.seq_id} computed {seq.num_computed} tokens, its table holds "
                f"{None if table is None else table.num_tokens}")
            assert len(table.blocks) == -(-table.num_tokens // bs), \
                f"sequence {seq.seq_id} holds {len(table.blocks)} blocks for {table.num_tokens} tokens"
        for seq in self.waiting:
            assert seq.table is None and seq.swapped is None, f"waiting sequence {seq.seq_id} holds KV"
        for seq in self.swapped:
            assert seq.table is None and seq.swapped is not None, \
                f"swapped sequence {seq.seq_id} holds device blocks"
        self.encodes.check_integrity({s.seq_id for s in (*self.waiting, *self.running, *self.swapped)})

    # -- preemption -----------------------------------------------------------------------------
    def _preempt(self, seq: Sequence) -> None:
        """Swap ``seq`` out or drop it to recompute; either way it keeps only its computed tokens
        (slots this step reserved for it are given back first)."""
        self.kv.truncate(seq.table, seq.num_computed)
        self._release_images(seq)  # they stay cached; resuming takes them again
        if swap_or_drop(seq, self.kv, self._restore(seq).how, self.preemptions):
            seq.status = Status.SWAPPED
            self.swapped.append(seq)
        else:
            self.add(seq)

    def _restore(self, seq: Sequence) -> Restore:
        return restore_estimate(seq, self.kv, self.config.preemption, self.rebuild_flops, self.speeds)
