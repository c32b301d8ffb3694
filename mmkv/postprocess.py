"""Postprocessing: a step's results applied to its sequences, and the outputs they make.

In batch order: each computed chunk is committed (the scheduler caches the blocks it completed),
each sampled token appended, a parent's first token forking its ``n - 1`` samples (they share its
blocks, copy-on-write); each speculative verdict truncates its sequence's table to the accepted
positions (rejected K/V is never read again and never enters the radix tree), appends the
accepted tokens and the target's one, and commits them. A sequence ends at a stop token, a stop
string or its length limit; a request that raised in the step fails whole. Nothing here runs a
model.

Invariant: a sequence that finishes or fails releases its blocks in the same step.
"""

from __future__ import annotations

from typing import Callable

from cache import KVCache
from mmkv.detokenizer import IncrementalText
from mmkv.outputs import CompletionOutput, RequestOutput
from mmkv.request_table import RequestTable
from mmkv.runner import Sampled, StepResult
from mmkv.scheduler import ScheduledBatch, Scheduler
from mmkv.sequence import Sequence, Status
from speculative.verification import Verdict

Decode = Callable[[list[int]], str]


class Postprocessor:
    """Applies step results for one engine; counts the tokens it commits and appends.

    ``decode`` turns token ids into text (stop strings; None without a tokenizer);
    ``finished_by_itself`` hears of every sequence that ended at a stop token or string, with the
    tokens it generated (the speculation controller learns where outputs end)."""

    def __init__(self, scheduler: Scheduler, kv: KVCache, requests: RequestTable,
                 decode: Decode | None, max_model_len: int,
                 finished_by_itself: Callable[[int], None] | None = None) -> None:
        self.scheduler, self.kv, self.requests = scheduler, kv, requests
        self.decode, self.max_model_len = decode, max_model_len
        self.finished_by_itself = finished_by_itself
        self.counters = {"computed_prefill_tokens": 0, "decode_tokens": 0, "generated_tokens": 0}

    def process(self, batch: ScheduledBatch, result: StepResult) -> list[RequestOutput]:
        """Apply ``result``; the outputs of requests that progressed, then of those that failed
        (finished, ``error`` set, their blocks released)."""
        failed = dict(result.failed)
        failed.update((seq.request_id, err) for seq, err in batch.failed)
        touched: dict[int, None] = {}
        for seq, q in result.computed:
            phase = "decode_tokens" if q == 1 and seq.num_computed >= seq.prompt_len else "computed_prefill_tokens"
            self.counters[phase] += q
            self.scheduler.commit(seq, q)
            if not seq.params.max_tokens and seq.num_computed == len(seq.token_ids):  # a prompt only
                self._apply(seq, lambda seq=seq: self._finish(seq, "length"), failed, touched)
        for drawn in result.sampled:
            self._apply(drawn.seq, lambda drawn=drawn: self._append_sampled(drawn), failed, touched)
        for seq, verdict in result.verdicts:
            self._apply(seq, lambda seq=seq, verdict=verdict: self._apply_verdict(seq, verdict),
                        failed, touched)
        outputs = [self.output(r) for r in touched if r not in failed]
        return outputs + [self.fail(r, err) for r, err in failed.items()]

    @staticmethod
    def _apply(seq: Sequence, apply: Callable[[], None], failed: dict[int, BaseException],
               touched: dict[int, None]) -> None:
        if seq.request_id in failed:
            return
        try:
            apply()
        except Exception as err:
            failed.setdefault(seq.request_id, err)
            return
        touched[seq.request_id] = None

    def _append_sampled(self, drawn: Sampled) -> None:
        family = [drawn.seq]
        if len(drawn.tokens) > 1:
            family += self._fork(drawn.seq)  # before the parent's own token moves its grammar on
        for i, (seq, token) in enumerate(zip(family, drawn.tokens)):
            if drawn.logprobs is not None:
                seq.logprobs.append(drawn.logprobs[i])
            self._append(seq, token)

    def _apply_verdict(self, seq: Sequence, verdict: Verdict) -> None:
        self.kv.truncate(seq.table, len(seq.token_ids) + verdict.accepted)  # the target's K/V
        self.counters["decode_tokens"] += verdict.accepted + 1
        reason = None
        for token in verdict.tokens:
            if seq.constraint is not None:
                seq.constraint.accept(token)
            seq.token_ids.append(token)
            self.counters["generated_tokens"] += 1
            if (reason := self.finish_reason(seq, token)) is not None:
                break
        # Committed once the accepted drafts are in token_ids: blocks are cached by their keys.
        self.scheduler.commit(seq, verdict.accepted + 1)
        if reason is not None:
            self._finish(seq, reason)

    def _append(self, seq: Sequence, token: int) -> None:
        """Add a generated token (past its structured output's grammar, which allowed it); finish
        the sequence when it should stop."""
        if seq.constraint is not None:
            seq.constraint.accept(token)
        seq.token_ids.append(token)
        self.counters["generated_tokens"] += 1
        reason = self.finish_reason(seq, token)
        if reason is not None:
            self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        if self.finished_by_itself is not None and reason == "stop":  # not one cut at its limit
            self.finished_by_itself(seq.num_generated)
        self.scheduler.finish(seq)

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """The parent's samples 1 .. n-1, sharing its blocks (copy-on-write) and drawing with
        their own generators."""
        children = []
        for i, generator in enumerate(parent.fork_generators, start=1):
            child = Sequence(seq_id=self.requests.new_id(), request_id=parent.request_id, index=i,
                             token_ids=list(parent.token_ids), prompt_len=parent.prompt_len,
                             params=parent.params, arrival=parent.arrival,
                             arrival_time=parent.arrival_time, namespace=parent.namespace,
                             generator=generator, stop_token_ids=parent.stop_token_ids,
                             table=self.kv.fork(parent.table), num_computed=parent.num_computed,
                             num_cached_blocks=parent.num_cached_blocks, admitted=True,
                             cached_tokens=parent.cached_tokens, images=parent.images,
                             logprobs=None if parent.logprobs is None else list(parent.logprobs),
                             image_tables=[self.kv.fork(t) for t in parent.image_tables],
                             rope=parent.rope,
                             constraint=None if parent.constraint is None else parent.constraint.fork())
            self.scheduler.add_running(child)
            self.requests.add(child)
            children.append(child)
        return children

    def finish_reason(self, seq: Sequence, token: int) -> str | None:
        """Why ``seq`` ends with ``token`` just appended (None: it goes on)."""
        p = seq.params
        if token in seq.stop_token_ids or (seq.constraint is not None and seq.constraint.finished):
            return "stop"
        if p.stop and self.decode is not None:
            # Only text that this token completed can hold a new match.
            if seq.stop_text is None:
                seq.stop_text = IncrementalText(self.decode, start=seq.prompt_len)
            seen = len(seq.stop_text.text)
            text = seq.stop_text.current(seq.token_ids)
            hits = [i for i in (text.find(s, max(0, seen - len(s) + 1)) for s in p.stop)
                    if i >= 0 and seq.num_generated > p.min_tokens]  # none within the first min_tokens
            if hits:
                seq.text = text[: min(hits)]
                return "stop"
        if seq.num_generated >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return "length"
        return None

    # -- outputs --------------------------------------------------------------------------------
    def output(self, request_id: int) -> RequestOutput:
        """The request's output now; a finished request leaves the table."""
        seqs = self.requests.family(request_id)
        outputs = []
        for s in sorted(seqs, key=lambda s: s.index):
            stopped = s.text if s.finish_reason == "stop" and s.text else None  # cut at the stop string
            outputs.append(CompletionOutput(s.index, s.output_ids, s.finish_reason,
                                            None if s.logprobs is None else list(s.logprobs),
                                            decode=self.decode, decoded=stopped))
        finished = all(s.status is Status.FINISHED for s in seqs) and len(seqs) == seqs[0].params.n
        if finished:
            self.requests.pop(request_id)
        first = min(seqs, key=lambda s: s.index)  # the parent: the request's admission
        prompt_logprobs = None if first.prompt_logprobs is None else list(first.prompt_logprobs)
        return RequestOutput(request_id, first.token_ids[: first.prompt_len], outputs, finished,
                             first.cached_tokens, reuse=first.reuse, prompt_logprobs=prompt_logprobs)

    def abort(self, request_id: int) -> bool:
        """Stop a request now: its sequences leave the scheduler and every block they hold
        (running, waiting or swapped) is released. False when it is unknown or finished."""
        seqs = self.requests.pop(request_id)
        if seqs is None:
            return False
        for seq in seqs:
            seq.finish_reason = "abort"
            self.scheduler.finish(seq)
        return True

    def fail(self, request_id: int, err: BaseException) -> RequestOutput:
        """End a request that raised inside a step; its output carries the error."""
        first = self.requests.family(request_id)[0]
        self.abort(request_id)
        return RequestOutput(request_id, first.token_ids[: first.prompt_len], [], True,
                             first.cached_tokens, error=f"{type(err).__name__}: {err}")

