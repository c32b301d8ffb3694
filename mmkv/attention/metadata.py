"""One engine step's attention metadata in FlashInfer's paged format.

For a batch of sequences, sequence ``i`` contributes ``q_lens[i]`` new tokens (packed one after the
other) and, after they are written, has ``kv_lens[i]`` tokens of KV in the pages ``pages[i]``.
``qo_indptr``, ``kv_indptr``, ``kv_indices`` and ``kv_last_page_len`` are exactly the int32 arrays
FlashInfer's wrappers take, on the device (for its K/V writes) and on the host (``host``, for its
``plan()`` calls); the torch backend reads the same arrays (plus host-side lengths, so it never
synchronises with the device to learn a length).

Sequences with at most ``SHORT_QUERY`` new tokens (decode steps, speculative verification, short
prompt suffixes after a cached prefix) are planned to be attended together in buckets of similar
query lengths (1, 2, 3-4, 5-8, ... 33-64 new tokens), each sequence's queries padded to its bucket's
longest, so padding never more than doubles a bucket's queries; longer ones (prompt chunks) are
attended one at a time. A bucket is split again by the pages each sequence reads after its shared
ones (1-4, 5-8, 9-16, ... pages), so one long lone sequence does not pad a batch of short
suffixes to its length.

Cascade: short-query sequences whose page lists start with the same full pages, all before their
first new token, form a group; the shared pages are attended once for the whole group and merged
with each sequence's own suffix by log-sum-exp (the CPU form of FlashInfer's multi-level cascade
attention).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch

from mmkv.host_arrays import host_ints, longs

SHORT_QUERY = 64  # most new tokens of a sequence attended in the batched (short-query) path


@dataclass(frozen=True, slots=True)
class OneCallLimits:
    """When the native kernel attends a step's cross-attention groups in one call: at most
    ``queries`` rows a group; or at most ``work`` rows x keys; or, with ``groups`` groups or more,
    at most twice ``queries`` rows. The kernel walks every row over the pages where SDPA runs a
    GEMM on a gathered copy, and the torch path pays that gather and a call per group: the one call
    wins for few rows a group, little work, or many groups, SDPA for many rows over many keys. The
    limits rest on timings of the two (docs/attention-and-kernels.md);
    ``python -m mmkv.bench cross --json`` measures the one call end to end."""

    queries: int = 8
    work: int = 4096
    groups: int = 4

    def allow(self, groups: int, rows: int, keys: int) -> bool:
        """Whether ``groups`` groups of at most ``rows`` rows over at most ``keys`` keys go in one
        call."""
        return (rows <= self.queries or rows * keys <= self.work
                or (groups >= self.groups and rows <= 2 * self.queries))


ONE_CALL = OneCallLimits()


@dataclass(slots=True)
class CascadeGroup:
    """Short-query sequences (positions in ``DecodePlan.rows``) that share ``shared_pages``."""

    members: torch.Tensor  # long [m], positions into the decode list
    shared_pages: torch.Tensor  # long [p]
    seqs: list[int]  # the same sequences, as indices into the batch
    num_pages: int  # p


@dataclass(slots=True)
class HostPages:
    """The paged metadata's int32 arrays on the host (what FlashInfer's ``plan()`` is given)."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor


@dataclass(slots=True)
class DecodePlan:
    """How one bucket of short-query sequences is attended, batched. Queries are padded to the
    bucket's longest by repeating a sequence's last one (same row, same position, so the same
    result). What no query may see (padding and later positions) is the same for every layer, so
    its mask is built once per step, when a layer first asks for it (the native kernel and a lone
    sequence need none)."""

    rows: torch.Tensor  # long [d, m], packed token row of each sequence's queries
    pages: torch.Tensor  # long [d, max_pages], each sequence's pages after its shared ones (padded)
    lens: torch.Tensor  # long [d], KV tokens in those pages
    host_lens: list[int]  # the same, on the host
    positions: torch.Tensor  # long [d, m], absolute position of each query
    key_start: torch.Tensor  # long [d], absolute position of the first slot of those pages
    groups: list[CascadeGroup]
    in_order: bool = False  # rows is arange(d * m).view(d, m): the first d sequences, m rows each
    biases: dict = field(default_factory=dict)  # additive masks built for this step, by bias()

    def bias(self, group_size: int, window: int | None, block_size: int) -> torch.Tensor:
        """Additive mask (0 / -inf) ``[d, 1, m * group_size, L]`` for query rows laid out query-major
        with ``group_size`` query heads per KV head, built once per step for each layout."""
        key = (group_size, window)
        if key not in self.biases:
            # the absolute position of each slot of the sequence's pages [d, L]
            key_positions = self.key_start[:, None] + torch.arange(self.pages.shape[1] * block_size,
                                                                   device=self.pages.device)
            blocked = _blocked(self.lens, self.positions, key_positions)
            if window is not None:
                blocked = blocked | (key_positions[:, None, :]
                                     <= self.positions[:, :, None] - window)[:, None, :, None, :]
            d, _, m, _, length = blocked.shape
            bias = torch.zeros((d, 1, m, group_size, length), device=blocked.device)
            self.biases[key] = bias.masked_fill_(blocked, float("-inf")).view(d, 1, -1, length)
        return self.biases[key]


@dataclass(slots=True)
class PagedBatch:
    """Metadata of one forward step over the paged KV cache."""

    block_size: int
    qo_indptr: torch.Tensor  # int32 [B+1]
    kv_indptr: torch.Tensor  # int32 [B+1]
    kv_indices: torch.Tensor  # int32 [nnz pages]
    kv_last_page_len: torch.Tensor  # int32 [B]
    host: HostPages  # the same four arrays on the host
    positions: torch.Tensor  # long [T], position of every new token in its sequence
    write_slots: torch.Tensor  # long [2T]: rows of a layer viewed [pages * 2 * block_size, heads,
    # dim] that receive each new token's K, then each one's V (page * 2 * block_size + slot, + block_size)
    q_lens: list[int]
    kv_lens: list[int]
    prefill: list[int]  # sequences with more than SHORT_QUERY new tokens, attended one at a time
    prefill_pages: list[torch.Tensor]  # long page ids of each of those (on the device)
    decode: list[DecodePlan]  # the others, attended together per bucket of query lengths
    masks: dict = field(default_factory=dict)  # prompt chunks' additive causal masks, built once a step

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)

    @property
    def cascade_groups(self) -> list[CascadeGroup]:
        return [group for plan in self.decode for group in plan.groups]


def _shared_full_pages(tables: list[list[int]], kv_lens: list[int], q_lens: list[int],
                       block_size: int) -> int:
    """Number of leading pages identical in every table and wholly before every new token (so
    every query sees all of them)."""
    limit = min((n - q) // block_size for n, q in zip(kv_lens, q_lens))
    first = tables[0][:limit]
    n = limit
    for t in tables[1:]:
        if t[:n] != first[:n]:  # one list comparison per table; a page walk only where they part
            n = next(j for j in range(n) if t[j] != first[j])
    return n


def plan_batch(tables: list[list[int]], q_lens: list[int], kv_lens: list[int], block_size: int,
               device: torch.device, cascade: bool = True) -> PagedBatch:
    """Build the metadata for sequences with page lists ``tables`` (covering ``kv_lens`` tokens
    each, the last ``q_lens`` of which are new this step)."""
    if not (len(tables) == len(q_lens) == len(kv_lens)):
        raise ValueError("tables, q_lens and kv_lens must have one entry per sequence")
    pages = [t[: -(-n // block_size)] for t, n in zip(tables, kv_lens)]
    positions, key_slots = [], []
    for pg, q, n in zip(pages, q_lens, kv_lens):
        for pos in range(n - q, n):
            positions.append(pos)
            key_slots.append(pg[pos // block_size] * 2 * block_size + pos % block_size)
    qo = [0]
    kv = [0]
    for q, pg in zip(q_lens, pages):
        qo.append(qo[-1] + q)
        kv.append(kv[-1] + len(pg))

    host = HostPages(*(host_ints(x) for x in (
        qo, kv, [p for pg in pages for p in pg], [(n - 1) % block_size + 1 for n in kv_lens])))
    buckets: dict[int, list[int]] = {}
    prefill = []
    for i, q in enumerate(q_lens):
        if q <= SHORT_QUERY:
            buckets.setdefault((q - 1).bit_length(), []).append(i)
        else:
            prefill.append(i)
    return PagedBatch(
        block_size=block_size,
        qo_indptr=host.qo_indptr.to(device), kv_indptr=host.kv_indptr.to(device),
        kv_indices=host.kv_indices.to(device), kv_last_page_len=host.kv_last_page_len.to(device),
        host=host,
        positions=longs(positions, device),
        write_slots=longs(key_slots + [k + block_size for k in key_slots], device),
        q_lens=list(q_lens), kv_lens=list(kv_lens), prefill=prefill,
        prefill_pages=[longs(pages[i], device) for i in prefill],
        decode=[plan for _, ids in sorted(buckets.items())
                for plan in _plan_decode(ids, pages, q_lens, kv_lens, qo, block_size, device, cascade)],
    )


def next_position(batch: PagedBatch) -> PagedBatch | None:
    """The metadata for computing the next position of every sequence of ``batch`` (a batch of one
    new token per sequence, e.g. a speculative draft pass after the previous one), or ``None`` when
    a sequence's next position starts a page (plan afresh then).

    Inside the pages nothing but the lengths and positions move, so this equals ``plan_batch`` on
    the same tables with every ``kv_len`` one larger, without rebuilding every array.
    """
    if any(q != 1 for q in batch.q_lens) or any(n % batch.block_size == 0 for n in batch.kv_lens):
        return None
    host = batch.host
    last = batch.kv_last_page_len + 1
    # on the CPU the host arrays are the device arrays: one addition serves both
    host_last = last if host.kv_last_page_len is batch.kv_last_page_len else host.kv_last_page_len + 1
    return PagedBatch(block_size=batch.block_size, qo_indptr=batch.qo_indptr, kv_indptr=batch.kv_indptr,
                      kv_indices=batch.kv_indices, kv_last_page_len=last,
                      host=HostPages(host.qo_indptr, host.kv_indptr, host.kv_indices, host_last),
                      positions=batch.positions + 1, write_slots=batch.write_slots + 1,
                      q_lens=batch.q_lens, kv_lens=[n + 1 for n in batch.kv_lens], prefill=batch.prefill,
                      prefill_pages=batch.prefill_pages,
                      decode=[_next_decode_position(plan) for plan in batch.decode])


def _next_decode_position(plan: DecodePlan) -> DecodePlan:
    return DecodePlan(rows=plan.rows, pages=plan.pages, lens=plan.lens + 1,
                      host_lens=[n + 1 for n in plan.host_lens], positions=plan.positions + 1,
                      key_start=plan.key_start, groups=plan.groups, in_order=plan.in_order)


def _blocked(lens: torch.Tensor, positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
    """Where a padded query row must not attend: slots past a sequence's keys, and positions
    after the query's own."""
    index = torch.arange(key_positions.shape[1], device=lens.device)
    allowed = (index[None, :] < lens[:, None])[:, None, :] \
        & (key_positions[:, None, :] <= positions[:, :, None])  # [d, m, L]
    return ~allowed[:, None, :, None, :]


def _plan_decode(ids: list[int], pages: list[list[int]], q_lens: list[int], kv_lens: list[int],
                 qo: list[int], block_size: int, device: torch.device, cascade: bool) -> list[DecodePlan]:
    """The plans of one bucket of query lengths: its sequences split by how many pages each reads
    after its shared ones (``_width_class``), one plan per class; a cascade group's members in one
    class attend their shared pages together."""
    group_of: dict[int, tuple[int, int]] = {}  # sequence -> (its group's first page, shared pages)
    if cascade:
        by_first: dict[int, list[int]] = {}
        for i in ids:
            if kv_lens[i] > block_size:
                by_first.setdefault(pages[i][0], []).append(i)
        for first, seqs in by_first.items():
            if len(seqs) < 2:
                continue
            n = _shared_full_pages([pages[i] for i in seqs], [kv_lens[i] for i in seqs],
                                   [q_lens[i] for i in seqs], block_size)
            group_of.update((i, (first, n)) for i in seqs if n)
    classes: dict[int, dict[tuple[int, int], list[int]]] = {}
    for i in ids:
        key = group_of.get(i, (-1 - i, 0))  # a sequence alone: its own key, no shared pages
        classes.setdefault(_width_class(len(pages[i]) - key[1]), {}).setdefault(key, []).append(i)
    return [_decode_plan(list(units.items()), pages, q_lens, kv_lens, qo, block_size, device)
            for _, units in sorted(classes.items())]


def _width_class(pages: int) -> int:
    """Sequences are batched with others of the same class, so padding at most doubles the pages
    read per sequence; below ``4`` pages, where a kernel call costs more than padding, one class."""
    return ((pages - 1) // 4).bit_length()


def _decode_plan(units: list[tuple[tuple[int, int], list[int]]], pages: list[list[int]],
                 q_lens: list[int], kv_lens: list[int], qo: list[int], block_size: int,
                 device: torch.device) -> DecodePlan:
    """One plan over ``units``: ``((first page, shared pages), sequences)``, a cascade group's
    members or (shared pages 0) one sequence."""
    ids = [i for _, seqs in units for i in seqs]
    shared = {i: n for (_, n), seqs in units for i in seqs}
    groups, start = [], 0
    for (_, n), seqs in units:
        if n:
            groups.append(CascadeGroup(
                members=torch.arange(start, start + len(seqs), dtype=torch.long, device=device),
                shared_pages=longs(pages[seqs[0]][:n], device), seqs=seqs, num_pages=n))
        start += len(seqs)
    suffix = [pages[i][shared[i]:] for i in ids]
    width = max(len(s) for s in suffix)
    padded = [s + [s[-1]] * (width - len(s)) for s in suffix]
    m = max(q_lens[i] for i in ids)
    rows = [[qo[i] + min(j, q_lens[i] - 1) for j in range(m)] for i in ids]
    lens = [kv_lens[i] - shared[i] * block_size for i in ids]
    positions = [[kv_lens[i] - q_lens[i] + min(j, q_lens[i] - 1) for j in range(m)] for i in ids]
    return DecodePlan(
        rows=longs(rows, device), pages=longs(padded, device), lens=longs(lens, device),
        host_lens=lens, positions=longs(positions, device),
        key_start=longs([shared[i] * block_size for i in ids], device),
        groups=groups,
        in_order=ids == list(range(len(ids))) and all(q_lens[i] == m for i in ids),
    )


@dataclass
class CrossGroup:
    """Query tokens of sequences that attend to the same images (so the same pages), held on the
    host: the tensors the torch path and FlashInfer's masks read are built when first read, so a
    step the native kernel attends in one call (``CrossBatch.one_call``) builds none of them."""

    row_list: list[int]  # packed token rows
    page_list: list[int]  # the images' pages, image after image
    masks: list[list[bool]]  # the distinct visibility patterns of its rows, kv_len positions each
    pattern_of_row: list[int]  # each row's pattern in masks
    block_size: int
    device: torch.device

    @property
    def kv_len(self) -> int:
        """Pages x block size (positions past an image's tokens are masked)."""
        return len(self.page_list) * self.block_size

    @functools.cached_property
    def visible_len(self) -> int:
        """No row attends to a position from here on."""
        return max(len(m) - m[::-1].index(True) for m in self.masks)

    @functools.cached_property
    def uniform(self) -> bool:
        """Every row attends to every position before ``visible_len``."""
        return all(all(m[:self.visible_len]) for m in self.masks)

    @functools.cached_property
    def rows(self) -> torch.Tensor:
        return longs(self.row_list, self.device)

    @functools.cached_property
    def pages(self) -> torch.Tensor:
        return longs(self.page_list, self.device)

    @functools.cached_property
    def allowed(self) -> torch.Tensor:
        """bool [rows, kv_len]: the positions each row attends to."""
        masks = torch.from_numpy(np.array(self.masks, dtype=np.bool_)).to(self.device)
        return masks[longs(self.pattern_of_row, self.device)]


@dataclass(slots=True)
class OneCallCross:
    """A step's groups as one batch of the native decode kernel: group ``g`` is its sequence
    ``g``, its rows its queries (padded to the most rows a group has with copies of its first
    row), every key before the group's ``visible_len`` visible to every one of them."""

    queries: torch.Tensor  # long [d * m], the packed row of each query slot
    pages: torch.Tensor  # long [d, most pages], each group's pages (padded with its last)
    lens: torch.Tensor  # long [d], each group's visible_len
    key_start: torch.Tensor  # long [d], zeros: image positions count from 0
    positions: torch.Tensor  # long [d, m], past every key of the group: all visible
    slots: torch.Tensor | None  # long [n], the query slots holding real rows (None: all of them)
    rows: torch.Tensor  # long [n], their packed rows


@dataclass(slots=True)
class CrossBatch:
    """Cross-attention metadata of one step (non-causal attention over image K/V pages).

    ``row_mask`` is 1 for rows that see at least one image and 0 otherwise; rows of sequences
    without images get no cross-attention output at all. ``one_call`` is set when every group is
    ``CrossGroup.uniform`` and the groups have few rows for their keys and number
    (``OneCallLimits``): then one native kernel call attends every group where its pages lie.
    """

    groups: list[CrossGroup]
    row_mask: torch.Tensor  # float [T]
    one_call: OneCallCross | None = None


@dataclass(slots=True)
class CrossSequence:
    """One sequence's part of a cross-attention step."""

    rows: list[int]  # packed rows of its new tokens
    positions: list[int]  # their positions
    prompt_len: int
    images: list[tuple[list[int], int, int, int, int | None]]
    # per image: (pages, tokens, valid tokens, first visible position, end of visibility or None)


def plan_cross(seqs: list[CrossSequence], num_tokens: int, block_size: int, device: torch.device,
               dtype: torch.dtype, limits: OneCallLimits | None = ONE_CALL) -> CrossBatch:
    """Visibility follows Mllama: image ``i`` is seen from its placeholder up to (not including)
    ``end``; generated tokens see what the last prompt token sees; a row that sees no image
    attends to every image token of its sequence and its cross-attention MLP output is masked.

    Built on the host: a sequence's rows take one of a few visibility patterns (a decode row
    always the same one), so each group keeps its distinct masks and each row's pattern, and its
    tensors are built only if a path reads them (``CrossGroup``). ``limits``: when the groups go
    to the native kernel in one call (None: never).
    """
    row_mask = [0.0] * num_tokens
    by_pages: dict[tuple[int, ...], tuple[list[int], list[list[bool]], list[int]]] = {}
    for seq in seqs:
        if not seq.images:
            continue
        pages = tuple(p for img in seq.images for p in img[0])
        rows, masks, pattern_of_row = by_pages.setdefault(pages, ([], [], []))
        spans, offset = [], 0  # per image: (offset, tokens, valid, start, end)
        for img_pages, tokens, valid, start, end in seq.images:
            spans.append((offset, tokens, valid, start, end))
            offset += len(img_pages) * block_size
        patterns: dict[tuple[bool, ...], int] = {}  # which images a row sees -> its mask in masks
        for row, pos in zip(seq.rows, seq.positions):
            p = min(pos, seq.prompt_len - 1)
            sees = tuple(valid > 0 and start <= p and (end is None or p < end)
                         for _, _, valid, start, end in spans)
            if sees not in patterns:
                patterns[sees] = len(masks)
                masks.append(_cross_mask(spans, sees, len(pages) * block_size))
            rows.append(row)
            pattern_of_row.append(patterns[sees])
            row_mask[row] = 1.0 if any(sees) else 0.0
    groups = [CrossGroup(rows, list(pages), masks, pattern_of_row, block_size, device)
              for pages, (rows, masks, pattern_of_row) in by_pages.items()]
    batch = None
    if limits is not None and groups and all(g.uniform for g in groups):
        m, keys = max(len(g.row_list) for g in groups), max(g.visible_len for g in groups)
        if limits.allow(len(groups), m, keys):
            batch = _one_call([(g.row_list, g.page_list, g.visible_len) for g in groups], m, device)
    return CrossBatch(groups, host_ints(row_mask, np.float32).to(device, dtype), batch)


def _one_call(groups: list[tuple[list[int], list[int], int]], m: int, device: torch.device) -> OneCallCross:
    """The kernel's batch of groups given as (rows, pages, visible_len), ``m`` rows the most."""
    width = max(len(pages) for _, pages, _ in groups)
    queries = [r for rows, _, _ in groups for r in rows + [rows[0]] * (m - len(rows))]
    slots = [g * m + j for g, (rows, _, _) in enumerate(groups) for j in range(len(rows))]
    lens = [visible for _, _, visible in groups]
    return OneCallCross(
        queries=longs(queries, device),
        pages=longs([pages + [pages[-1]] * (width - len(pages)) for _, pages, _ in groups], device),
        lens=longs(lens, device), key_start=longs([0] * len(groups), device),
        positions=longs([[n] * m for n in lens], device),
        slots=None if len(slots) == len(queries) else longs(slots, device),
        rows=longs([r for rows, _, _ in groups for r in rows], device))


def _cross_mask(spans: list[tuple[int, int, int, int, int | None]], sees: tuple[bool, ...],
                kv_len: int) -> list[bool]:
    """The image positions a row attends to: the valid tokens of the images it sees, or, if it
    sees none, every token of every image (its output is masked then)."""
    mask = [False] * kv_len
    for (offset, tokens, valid, _, _), seen in zip(spans, sees):
        n = valid if seen else 0 if any(sees) else tokens
        mask[offset:offset + n] = [True] * n
    return mask
