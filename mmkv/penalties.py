"""Logit adjustments that depend on a sequence's tokens so far: penalties and ``min_tokens``.

Applied to a row's raw logits, in this order, before its logit bias, its structured output's mask
and any sampling filter (vLLM's and transformers' order for the penalties):

- ``repetition_penalty`` ``r`` (transformers' ``RepetitionPenaltyLogitsProcessor``): every token
  in the prompt or the output so far has its logit divided by ``r`` where it is positive, else
  multiplied by ``r``.
- ``frequency_penalty`` ``f`` then ``presence_penalty`` ``p`` (OpenAI's): a token generated ``c``
  times so far has ``f * c`` subtracted, then ``p`` more if ``c > 0``. Only output tokens count.
- ``min_tokens`` ``m``: while fewer than ``m`` tokens were generated, the sequence's stop tokens
  (its EOS and ``stop_token_ids``) get ``-inf``.

Invariant: a row is adjusted by exactly the tokens before the one it predicts. A speculative
verification row ``j`` predicts the token after the ``j``-th draft, so it counts the output so far
and the ``j`` drafts before it (``adjust_draft_rows``): verification then sees what plain decoding
would have seen had the drafts been generated, and speculation changes no greedy token.

Every penalised row of a step is adjusted in one gather and one scatter per rule. What a sequence
counts is kept on the host as its tokens are appended (``TokenCounts``): a step costs the tokens
it added, not the prompt again.
"""

from __future__ import annotations

from typing import Sequence as Seq

import numpy as np
import torch

from mmkv.sequence import Sequence, TokenCounts


def counts(seq: Sequence) -> TokenCounts:
    """``seq``'s counts, brought up to date (the distinct tokens only where a repetition penalty
    reads them)."""
    if seq.penalty_counts is None:
        seq.penalty_counts = TokenCounts()
    kept = seq.penalty_counts
    if kept.counted < len(seq.token_ids):
        if seq.params.repetition_penalty != 1.0:
            kept.seen = np.union1d(kept.seen, seq.tokens_array()[kept.counted:])
        for token in seq.token_ids[max(kept.counted, seq.prompt_len):]:
            kept.output[token] = kept.output.get(token, 0) + 1
        kept.counted = len(seq.token_ids)
    return kept


def adjust_rows(logits: torch.Tensor, rows: list[int], seqs: list[Sequence],
                drafted: Seq[Seq[int]] | None = None) -> None:
    """In place: row ``rows[i]`` of ``logits [rows, vocab]`` predicts the next token of ``seqs[i]``
    after the drafts ``drafted[i]`` (none by default), counted as generated."""
    repeat: list[tuple[int, np.ndarray, float]] = []  # row, tokens seen, repetition penalty
    output: list[tuple[int, np.ndarray, np.ndarray, float, float]] = []  # row, ids, counts, f, p
    stop: list[tuple[int, np.ndarray]] = []  # row, tokens refused
    for i, (row, seq) in enumerate(zip(rows, seqs)):
        params = seq.params
        if not params.penalised:
            continue
        kept, before = counts(seq), drafted[i] if drafted is not None else ()
        if params.repetition_penalty != 1.0:
            seen = np.union1d(kept.seen, np.asarray(before, dtype=np.int64)) if before else kept.seen
            repeat.append((row, seen, params.repetition_penalty))
        if params.frequency_penalty or params.presence_penalty:
            generated = kept.output
            if before:
                generated = dict(generated)
                for token in before:
                    generated[token] = generated.get(token, 0) + 1
            if generated:
                output.append((row, np.fromiter(generated, dtype=np.int64, count=len(generated)),
                               np.fromiter(generated.values(), dtype=np.float64, count=len(generated)),
                               params.frequency_penalty, params.presence_penalty))
        if seq.num_generated + len(before) < params.min_tokens and seq.stop_token_ids:
            stop.append((row, np.fromiter(seq.stop_token_ids, dtype=np.int64)))
    if repeat:
        index = _index(logits, [(row, ids) for row, ids, _ in repeat])
        penalty = _spread(logits, [(ids, r) for _, ids, r in repeat])
        values = logits[index]
        logits[index] = torch.where(values > 0, values / penalty, values * penalty)
    if output:
        index = _index(logits, [(row, ids) for row, ids, *_ in output])
        frequency = np.concatenate([f * n for _, _, n, f, _ in output])  # f * c in float64, as OpenAI's rule reads
        presence = _spread(logits, [(ids, p) for _, ids, _, _, p in output])
        logits[index] = logits[index] - _tensor(logits, frequency) - presence
    if stop:
        logits[_index(logits, stop)] = float("-inf")


def adjust_draft_rows(logits: torch.Tensor, starts: list[int], seqs: list[Sequence],
                      drafts: list[list[int]]) -> None:
    """In place, for each sequence's round rows ``starts[i] .. starts[i] + len(drafts[i])`` of
    ``logits``: row ``starts[i] + j`` predicts the token after its ``j``-th draft, so it counts
    the drafts before it as generated."""
    rows, owners, before = [], [], []
    for start, seq, d in zip(starts, seqs, drafts):
        if seq.params.penalised:
            rows += range(start, start + len(d) + 1)
            owners += [seq] * (len(d) + 1)
            before += [d[:j] for j in range(len(d) + 1)]
    if rows:
        adjust_rows(logits, rows, owners, before)


def _tensor(logits: torch.Tensor, values: np.ndarray) -> torch.Tensor:
    """Host ``values`` as a tensor beside ``logits``, in its dtype."""
    return torch.from_numpy(values).to(device=logits.device, dtype=logits.dtype)


def _index(logits: torch.Tensor, entries: list[tuple[int, np.ndarray]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The (row, token) pairs of every row's tokens, as an advanced index of ``logits``."""
    rows = np.repeat(np.fromiter((row for row, _ in entries), dtype=np.int64, count=len(entries)),
                     [len(ids) for _, ids in entries])
    tokens = np.concatenate([ids for _, ids in entries])
    return torch.from_numpy(rows).to(logits.device), torch.from_numpy(tokens).to(logits.device)


def _spread(logits: torch.Tensor, entries: list[tuple[np.ndarray, float]]) -> torch.Tensor:
    """Each row's value repeated for each of its tokens, in ``logits``' dtype."""
    return _tensor(logits, np.repeat([value for _, value in entries], [len(ids) for ids, _ in entries]))
