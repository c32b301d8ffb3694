"""Vision encoding off the engine thread: a request waits in the queue while its images encode.

Each step the scheduler starts (``prefetch``) the encoding of the images the waiting sequences it
may admit next must have encoded (their in-prompt images that their cached prefix does not cover,
or their cross-attention images whose K/V the cache does not hold) on a worker thread, and at
admission asks ``ready`` whether those are held for the sequence; while they are not, it stays
waiting and the engine goes on stepping the other sequences. When no sequence runs there is
nothing to overlap, and the scheduler waits for every encoding (``prefetch``) before admitting:
a batch submitted to an idle engine is then admitted exactly as if the encoder ran inline, so
its steps do not depend on the encoder's speed.

Invariants:

- The engine thread never runs the vision encoder for a sequence it admits: a sequence is admitted
  only once every image it must encode is held for it (``VisionPipeline.hold``), and what is held
  stays held until the sequence ends (``release``), so neither its prefill chunks nor its
  cross-attention K/V, nor its recomputation after a preemption, encode again.
- With ``shared``, an image is encoded once while its embeddings are cached, held or being
  encoded: a sequence needing an image another one's job is encoding waits for that job. The job
  counts in the ``reuse.images_encoded`` of the sequence that started it, so these counts add up
  to the encoder's calls. Without ``shared`` (caching off), every sequence encodes its own images.
- A failed encoding fails the sequences waiting on it, and nothing else: ``ready`` raises the
  encoder's exception for each of them, which then holds nothing here; a later request encodes
  the image again.
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cache import KVCache
from mmkv.sequence import SeqImage, Sequence
from vision import VisionPipeline

if TYPE_CHECKING:
    from mmkv.image_kv import CrossAttentionKV


@dataclass(slots=True)
class _Job:
    uid: int
    future: Future
    owner: Sequence  # counts the encoder call
    waiters: list[Sequence]


class EncoderQueue:
    """One engine's image encodings, run one at a time on a worker thread. ``shared``: sequences
    share encodings (prefix caching on). Without ``vision`` (a text model) no sequence has an
    image, and every call returns at once."""

    def __init__(self, vision: VisionPipeline | None, kv: KVCache, image_kv: CrossAttentionKV | None,
                 shared: bool = True) -> None:
        self.vision, self.kv, self.image_kv = vision, kv, image_kv
        self.shared = shared
        self._executor: ThreadPoolExecutor | None = None  # started at the first encoding
        self._jobs: dict[tuple[int, int], _Job] = {}  # (uid, seq_id or -1 when shared) -> pending
        self._held: dict[int, set[int]] = {}  # seq_id -> uids held for it
        self._failed: dict[int, BaseException] = {}  # seq_id -> why its image's encoding failed

    def to_encode(self, seq: Sequence, cached: int | None = None) -> list[SeqImage]:
        """The images ``seq`` must have encoded to be admitted now: its cross-attention images
        whose K/V the cache lacks, or its in-prompt images with tokens after its first ``cached``
        (None: after the prefix the cache holds now), which its prefill reads."""
        if self.image_kv is not None:
            return self.image_kv.needs_encoding(seq)
        if cached is None:
            n = len(seq.token_ids) - 1
            cached = min(self.kv.tree.cached_length(seq.keys(n), seq.namespace), n) if self.shared else 0
        return [i for i in seq.images if i.in_sequence and i.start + i.placement.prompt_tokens > cached]

    def ready(self, seq: Sequence, cached: int | None = None) -> bool:
        """Whether the embeddings of what ``seq`` must have encoded (``to_encode``) are held for
        it; starts encoding those neither held, cached nor being encoded. Raises the encoder's
        exception when encoding one of them failed; ``seq`` then holds nothing here."""
        if not seq.images:
            return True
        self._collect()
        if seq.seq_id in self._failed:
            err = self._failed.pop(seq.seq_id)
            self.release(seq)
            raise err
        return self._start(seq, self.to_encode(seq, cached))

    def prefetch(self, seqs: list[Sequence], wait: bool) -> None:
        """Start encoding what each of ``seqs`` must have encoded and holds not; with ``wait``
        (no sequence runs), return once every encoding started so far has finished."""
        self._collect()
        for seq in seqs:
            if seq.images and seq.seq_id not in self._failed:
                self._start(seq, self.to_encode(seq))
        if wait:
            wait_for([job.future for job in self._jobs.values()])

    def _start(self, seq: Sequence, images: list[SeqImage]) -> bool:
        held = self._held.setdefault(seq.seq_id, set())
        # a list, not a generator: every missing image's job starts now, not only the first's
        return all([image.image.uid in held or self._take(seq, image, held) for image in images])

    def _take(self, seq: Sequence, image: SeqImage, held: set[int]) -> bool:
        """Hold ``image`` for ``seq`` if its embeddings exist, else wait for (or start) its job."""
        uid = image.image.uid
        key = (uid, -1 if self.shared else seq.seq_id)
        job = self._jobs.get(key)
        if job is not None:
            if seq not in job.waiters:
                job.waiters.append(seq)
            return False
        known = self.vision.held(uid) if self.shared else None
        if known is None and self.shared:
            known = self.vision.cache.get(uid)
        if known is not None:
            self.vision.hold(uid, known)
            held.add(uid)
            return True
        self._jobs[key] = _Job(uid, self._worker().submit(self.vision.encoder.encode, image.image.inputs),
                               seq, [seq])
        return False

    def _worker(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="mmkv-encoder")
        return self._executor

    def _collect(self) -> None:
        """Hand every finished job's embeddings to its waiters (or its error)."""
        for key, job in [(k, j) for k, j in self._jobs.items() if j.future.done()]:
            del self._jobs[key]
            err = job.future.exception()
            if err is not None:
                self._failed.update((s.seq_id, err) for s in job.waiters)
                continue
            value = job.future.result()
            if self.shared:
                self.vision.cache.put(job.uid, value)
            job.owner.reuse.images_encoded += 1
            for seq in job.waiters:
                self.vision.hold(job.uid, value)
                self._held.setdefault(seq.seq_id, set()).add(job.uid)

    def wait(self, timeout: float) -> bool:
        """Block until an encoding finishes or ``timeout`` seconds pass; False at once when none
        is running or queued."""
        self._collect()
        if not self._jobs:
            return False
        wait_for([job.future for job in self._jobs.values()], timeout, FIRST_COMPLETED)
        return True

    def release(self, seq: Sequence) -> None:
        """``seq`` ended: release what is held for it and stop waiting on its jobs."""
        for uid in self._held.pop(seq.seq_id, ()):
            self.vision.release(uid)
        self._failed.pop(seq.seq_id, None)
        for job in self._jobs.values():
            if seq in job.waiters:
                job.waiters.remove(seq)

    def check_integrity(self, live: set[int]) -> None:
        """Embeddings are held only for sequences in ``live`` (the scheduler's)."""
        stale = [seq_id for seq_id, uids in self._held.items() if uids and seq_id not in live]
        assert not stale, f"embeddings held for ended sequences {stale}"
