"""The model runner: a scheduled batch through the model, tokens out.

For each pass the runner builds the step context (paged metadata, each layer's pages, image
inputs), runs the model through the attention backend and samples; a speculative round it hands
to the proposer (``speculative.proposers``), which drafts, verifies and returns verdicts. It
returns what each sequence produced (``StepResult``) and never changes a sequence's tokens, block
table, counts or status: postprocessing applies the result (``mmkv.postprocess``).

A forward pass writes K/V only into the slots the scheduler reserved, so a pass can run again:
when a batch raises, each request's sequences run again alone and a request that raises alone
has failed; the others' results stand.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from cache import KVCache
from mmkv.attention.metadata import ONE_CALL, CrossSequence, plan_batch, plan_cross
from mmkv.cpu_threads import DecodeThreads
from mmkv.heap import release_free_heap
from mmkv.host_arrays import longs
from mmkv.image_kv import CrossAttentionKV
from mmkv.models import ModelAdapter
from mmkv.models.mrope import step_positions
from mmkv.outputs import TokenLogprob
from mmkv.quantization.linear import release_dequantize_buffers
from mmkv.sampler import sample, token_logprob
from mmkv.scheduler import ScheduledBatch
from mmkv.sequence import Sequence
from mmkv import penalties, structured
from mmkv.step_context import AttentionBackend, StepContext
from speculative.config import SpeculativeConfig
from speculative.proposers import DraftModelSpeculator, EarlyExitSpeculator, Speculator
from speculative.verification import Verdict

IDLE_TRIM_GROWTH = 16 * 2**20  # resident bytes grown since the last trim that an idle engine trims


@dataclass(frozen=True, slots=True)
class AttentionPlanning:
    """How the runner plans attention. Every engine plans with both on; a benchmark measures what
    one saves by turning it off in an ``Engine`` subclass (``Engine.attention_planning``)."""

    shared_prefix: bool = True  # cascade: a group's shared pages attended once for all its rows
    one_call_cross: bool = True  # a decoding step's image cross-attention in one native call


class Sampled(NamedTuple):
    """The tokens drawn for a sequence whose last token was computed: one per sample (``n`` at a
    parent's first token, whose siblings postprocessing forks), with log-probabilities when the
    request asked for them."""

    seq: Sequence
    tokens: list[int]
    logprobs: list[TokenLogprob] | None


@dataclass(slots=True)
class StepResult:
    """What a step's passes produced, for postprocessing to apply."""

    computed: list[tuple[Sequence, int]] = field(default_factory=list)  # plain passes: new K/V
    sampled: list[Sampled] = field(default_factory=list)
    verdicts: list[tuple[Sequence, Verdict]] = field(default_factory=list)  # speculative rounds
    failed: dict[int, BaseException] = field(default_factory=dict)  # request id -> what it raised


class ModelRunner:
    """Runs batches for one model over one KV cache (and a speculator, when the engine
    speculates). On the CPU a step that only decodes, plainly or in a speculative round, runs on
    the intra-op thread count ``decode_threads`` measures fastest (every core otherwise, and again
    once the engine is idle): a round's passes (one row a sequence while drafting, a few in
    verification) are as small as a decoding step's. A round whose draft model first catches up
    prompt tokens does a prompt's work (``Speculator.catches_up_prompts``): every core, and no
    sample of the thread counts, which would set it beside rounds that only decode."""

    def __init__(self, model: ModelAdapter, kv: KVCache, attention: AttentionBackend,
                 image_kv: CrossAttentionKV | None, planning: AttentionPlanning,
                 speculative: SpeculativeConfig | None = None, draft: ModelAdapter | None = None,
                 check_bounds: bool = False) -> None:
        self.model, self.kv, self.attention, self.image_kv = model, kv, attention, image_kv
        self.check_bounds = check_bounds  # every step's native kernels check their page ids and slots
        self.shared_prefix = planning.shared_prefix
        self.one_call = ONE_CALL if planning.one_call_cross else None
        self.device = model.device
        self.decode_threads = self._decode_threads()
        self.speculator: Speculator | None = None
        if draft is not None:
            self.speculator = DraftModelSpeculator(model, draft, kv, speculative, self.context)
        elif speculative is not None:
            self.speculator = EarlyExitSpeculator(model, speculative, self.context)
        # passes timed through postprocessing, closed by ``step_done``: a pure decoding pass for
        # the speculation controller (rows, context, start) and a decoding step for the decoding
        # threads (threads, (a round?, sequences), start)
        self._plain_pass: tuple[int, int, tuple[float, int]] | None = None
        self._threads_pass: tuple[int, tuple[bool, int], float] | None = None

    def _decode_threads(self) -> DecodeThreads | None:
        cores = torch.get_num_threads()
        return DecodeThreads(cores) if self.device.type == "cpu" and cores > 1 else None

    def forget_decode_threads(self) -> None:
        """Choose the decoding thread count afresh (after the engine's calibration: its choice is
        the requests' batches' to make)."""
        if self.decode_threads is not None:
            self.decode_threads = DecodeThreads(self.decode_threads.wide)

    # -- the step -------------------------------------------------------------------------------
    def run(self, batch: ScheduledBatch) -> StepResult:
        """Compute the batch: its plain pass, then its speculative round."""
        result = StepResult()
        threads = self.decode_threads
        decoding = bool(batch.seqs or batch.drafting) and all(q == 1 for q in batch.q_lens)
        if batch.drafting and self.speculator.catches_up_prompts(batch.drafting, batch.draft_lengths):
            decoding = False  # the draft's pass over prompt tokens is a prompt's work
        if threads is not None:
            shape = (bool(batch.drafting), len(batch.seqs) + len(batch.drafting))  # steps compared alike
            count = threads.use(decoding, shape)
            if decoding:
                self._threads_pass = (count, shape, threads.clock())
        if batch.seqs:
            if batch.drafting and self.speculator is not None:
                self.speculator.step_start()  # the step's scheduling goes with its plain pass
            self._timed_plain(batch.seqs, batch.q_lens, result, not batch.drafting)
        if batch.drafting:
            self._run_round(batch.drafting, batch.draft_lengths, result)
        return result

    def step_done(self, idle: bool) -> None:
        """The step's result is applied: close the timings that run through postprocessing (the
        speculation controller's, as a step's cost includes applying it; the decoding threads').
        When the engine is ``idle``, give torch every core back and hand back the memory the
        steps worked in: the quantized layers' dequantization buffers and the C heap's free
        pages (a prefill's activations) once the process has grown by ``IDLE_TRIM_GROWTH`` since
        the last trim, so an idle engine holds its model, its KV pools and little else. (The next
        busy step faults those pages in again: an engine serving one short request at a time
        would pay that after every request.)"""
        if self._plain_pass is not None:
            self.speculator.observe("plain", *self._plain_pass)
            self._plain_pass = None
        if self.speculator is not None:
            self.speculator.round_applied()
        if self._threads_pass is not None:
            count, shape, start = self._threads_pass
            switches = self.decode_threads.switches
            self.decode_threads.observe(count, shape, self.decode_threads.clock() - start)
            if self.decode_threads.switches != switches and self.speculator is not None:
                self.speculator.forget_pass_costs()  # every pass runs on another thread count now
            self._threads_pass = None
        if idle:
            if self.decode_threads is not None:
                self.decode_threads.release()
            release_dequantize_buffers()
            release_free_heap(grown_by=IDLE_TRIM_GROWTH)

    def _timed_plain(self, seqs: list[Sequence], q_lens: list[int], result: StepResult,
                     alone: bool) -> None:
        """``_run_plain``; a pure decoding pass is timed for the speculation controller, from the
        step's start (its scheduling) through postprocessing when it is the step's only pass."""
        if self.speculator is None or any(q != 1 for q in q_lens):
            self._run_plain(seqs, q_lens, result)
            return
        context = sum(len(s.token_ids) for s in seqs)
        start = self.speculator.step_start() if alone else self.speculator.started()
        self._run_plain(seqs, q_lens, result)
        if alone:
            self._plain_pass = (len(seqs), context, start)
        else:
            self.speculator.observe("plain", len(seqs), context, start)

    def _run_plain(self, seqs: list[Sequence], q_lens: list[int], result: StepResult) -> None:
        """Compute the scheduled tokens and sample where a sequence's last token was computed;
        score the prompt tokens a chunk predicts for a request that asked for their logprobs.
        When the batch raises, each request runs alone and one that raises alone has failed."""
        # the sequences whose last token is computed now sample (unless they may generate nothing)
        sampling = [i for i, (s, q) in enumerate(zip(seqs, q_lens))
                    if s.num_computed + q == len(s.token_ids) and s.params.max_tokens]
        scored = [(i, p) for i, (s, q) in enumerate(zip(seqs, q_lens)) if s.params.prompt_logprobs is not None
                  for p in range(s.num_computed, min(s.num_computed + q, s.prompt_len - 1))]
        constrained = [row for row, i in enumerate(sampling) if seqs[i].params.constrained]
        chosen = [seqs[i] for i in sampling]
        try:
            logits = self._forward_plain(seqs, q_lens, sampling, scored)
        except Exception as err:
            groups: dict[int, list[int]] = {}
            for i, s in enumerate(seqs):
                groups.setdefault(s.request_id, []).append(i)
            if len(groups) == 1:
                result.failed[seqs[0].request_id] = err
                return
            for rows in groups.values():
                self._run_plain([seqs[i] for i in rows], [q_lens[i] for i in rows], result)
            return
        result.computed.extend(zip(seqs, q_lens))
        if scored:
            _score_prompts(seqs, scored, logits[len(sampling):])
            logits = logits[:len(sampling)]
        if constrained:  # penalties, logit biases and grammar masks, every constrained row at once
            with torch.inference_mode():  # the logits are the forward's inference tensor
                penalties.adjust_rows(logits, constrained, [chosen[row] for row in constrained])
                structured.apply_masks(logits, constrained, [chosen[row].constraint for row in constrained],
                                       [chosen[row].params.logit_bias for row in constrained])
        single = _single_tokens(chosen, logits)
        for row, seq in enumerate(chosen):
            try:
                drawn = (Sampled(seq, [single[row]], None) if row in single
                         else self._draw(seq, logits[row]))
            except Exception as err:
                result.failed.setdefault(seq.request_id, err)
                continue
            result.sampled.append(drawn)

    def _forward_plain(self, seqs: list[Sequence], q_lens: list[int], sampling: list[int],
                       scored: list[tuple[int, int]] = ()) -> torch.Tensor:
        """Logits at the last token of each sequence of ``sampling`` (the indices of those whose
        last token is computed now), then at each ``scored`` (sequence index, position). Writes
        K/V only into the reserved slots, so it can rerun."""
        kv_lens = [s.num_computed + q for s, q in zip(seqs, q_lens)]
        step = self.context(seqs, q_lens, kv_lens)
        input_ids = longs([t for s, q in zip(seqs, q_lens)
                           for t in s.token_ids[s.num_computed:s.num_computed + q]], self.device)
        starts = step.batch.host.qo_indptr[:-1].tolist()
        rows = longs([starts[i] + q_lens[i] - 1 for i in sampling]
                     + [starts[i] + p - seqs[i].num_computed for i, p in scored], self.device)
        logits = self.model.forward(input_ids, step, rows)
        if self.speculator is not None:
            self.speculator.follow(input_ids, step, seqs, q_lens)
        return logits

    def _draw(self, seq: Sequence, logits: torch.Tensor) -> Sampled:
        """The next token of ``seq`` by its sampling parameters, and at a parent's first token
        (n > 1) one for each of its samples, each drawn with its own generator."""
        generators = [seq.generator]
        if seq.params.n > 1 and not seq.output_ids and seq.index == 0:
            generators += seq.fork_generators
        tokens = sample(logits[None].expand(len(generators), -1), [seq.params] * len(generators),
                        generators)
        if seq.params.logprobs is None:
            return Sampled(seq, tokens, None)
        logprobs = torch.log_softmax(logits.float(), -1)
        return Sampled(seq, tokens, [token_logprob(logprobs, t, seq.params.logprobs) for t in tokens])

    def _run_round(self, seqs: list[Sequence], gammas: list[int], result: StepResult) -> None:
        """A speculative round; when it raises, the sequences decode plainly (failing alone) and
        their drafts' slots are given back as for a round that accepted nothing."""
        try:
            verdicts = self.speculator.round(seqs, gammas, [s.stop_token_ids for s in seqs])
        except Exception:
            plain = StepResult(failed=result.failed)
            self._run_plain(seqs, [1] * len(seqs), plain)
            result.verdicts.extend((drawn.seq, Verdict(drawn.tokens, 0)) for drawn in plain.sampled)
            return
        result.verdicts.extend(zip(seqs, verdicts))

    # -- step contexts --------------------------------------------------------------------------
    def context(self, seqs: list[Sequence], q_lens: list[int], kv_lens: list[int],
                images: bool = True) -> StepContext:
        """Paged metadata and (unless ``images`` is False) image inputs for computing the last
        ``q_lens[i]`` of the first ``kv_lens[i]`` positions of each sequence (slots reserved)."""
        cascade = self.shared_prefix and self.model.cascade_allowed(max(kv_lens))
        meta = plan_batch([s.table.blocks for s in seqs], q_lens, kv_lens, self.kv.block_size,
                          self.device, cascade=cascade)
        step = StepContext(meta, self.model.layer_views(self.kv.storage.stores[0]), self.attention,
                           check_bounds=self.check_bounds)
        if seqs[0].rope is not None:
            rope = step_positions([s.rope for s in seqs], q_lens, kv_lens)
            step.rope_positions = torch.from_numpy(rope).to(self.device)
        if images:
            self._add_image_inputs(step, seqs, q_lens, kv_lens, meta.host.qo_indptr[:-1].tolist())
        return step

    def _add_image_inputs(self, step: StepContext, seqs: list[Sequence], q_lens: list[int],
                          kv_lens: list[int], starts: list[int]) -> None:
        """Image embeddings for LLaVA's image tokens, cross-attention metadata for the rest."""
        rows: list[int] = []
        embeds: list[torch.Tensor] = []
        cross: list[CrossSequence] = []
        for seq, q, n, start in zip(seqs, q_lens, kv_lens, starts):
            lo, hi = n - q, n
            for image in seq.images:
                if not image.in_sequence:
                    continue
                a, b = max(lo, image.start), min(hi, image.start + image.placement.prompt_tokens)
                if a < b:
                    rows.extend(range(start + a - lo, start + b - lo))
                    embeds.append(self.model.vision.embeddings(image.image)[a - image.start:b - image.start])
            if self.image_kv is not None:
                cross.append(CrossSequence(
                    rows=list(range(start, start + q)), positions=list(range(lo, hi)),
                    prompt_len=seq.prompt_len,
                    images=[(t.blocks, i.placement.xattn_tokens, i.placement.xattn_valid, i.start,
                             i.visible_until) for i, t in zip(seq.images, seq.image_tables)]))
        if rows:
            step.image_rows = torch.tensor(rows, dtype=torch.long, device=self.device)
            step.image_embeds = torch.cat(embeds).to(self.device)
        if any(c.images for c in cross):
            step.cross = plan_cross(cross, step.batch.num_tokens, self.kv.block_size, self.device,
                                    self.model.dtype, self.one_call)


def _score_prompts(seqs: list[Sequence], scored: list[tuple[int, int]], logits: torch.Tensor) -> None:
    """Each ``scored`` (sequence index, position) row of ``logits`` predicts the prompt token after
    that position: its log-probability and the sequence's ``prompt_logprobs`` most likely tokens
    there, kept in ``Sequence.prompt_logprobs`` (a recomputed position is scored again, alike)."""
    logprobs = torch.log_softmax(logits.float(), -1)
    targets = longs([seqs[i].token_ids[p + 1] for i, p in scored], logprobs.device)
    chosen = logprobs.gather(1, targets[:, None])
    ranks = ((logprobs > chosen).sum(-1) + 1).tolist()
    chosen = chosen[:, 0].tolist()
    most = max(seqs[i].params.prompt_logprobs for i, _ in scored)
    values, ids = torch.topk(logprobs, most) if most else (logprobs[:, :0], logprobs[:, :0])
    values, ids = values.tolist(), ids.tolist()
    for row, (i, p) in enumerate(scored):
        seq, k = seqs[i], seqs[i].params.prompt_logprobs
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs = [None] * seq.prompt_len
        seq.prompt_logprobs[p + 1] = TokenLogprob(seq.token_ids[p + 1], chosen[row],
                                                  list(zip(ids[row][:k], values[row][:k])), ranks[row])


def _single_tokens(seqs: list[Sequence], logits: torch.Tensor) -> dict[int, int]:
    """The next token of every row whose sequence draws one token without logprobs, from one
    ``sample`` call over those rows; none where a row has nothing to sample (each row is then
    drawn alone, and fails alone)."""
    rows = [row for row, s in enumerate(seqs) if s.params.n == 1 and s.params.logprobs is None]
    if not rows:
        return {}
    chosen = [seqs[row] for row in rows]
    try:
        return dict(zip(rows, sample(logits[rows] if len(rows) < len(seqs) else logits,
                                     [s.params for s in chosen], [s.generator for s in chosen])))
    except ValueError:
        return {}
