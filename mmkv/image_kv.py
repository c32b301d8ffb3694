"""Cross-attention K/V of images, kept in the shared block pool under the image's uid.

An image's K/V for every cross-attention layer fill ``ceil(tokens / block_size)`` blocks, cached in
the radix tree under a namespace of their own with keys ``(0, uid << 32 | offset)`` and, for the
cost-based eviction policy, the cost of encoding the image and projecting its K/V again. A sequence
holds one reference per block while it runs; when no sequence does, the blocks are evictable by the
same policy as text. K/V are computed only for blocks the tree does not hold, and inserted right
after they are written, so requests admitted in the same step share them.
"""

from __future__ import annotations

import numpy as np

from cache import BlockTable, ImageSpan, KVCache, make_keys
from mmkv.models import ModelAdapter
from mmkv.sequence import SeqImage, Sequence
from mmkv.step_context import AttentionBackend


class CrossAttentionKV:
    """Guarantees: a sequence that ``acquire`` accepted holds, per image, blocks whose K/V are the
    image's (one copy shared by every holder) until ``release``."""

    def __init__(self, kv: KVCache, model: ModelAdapter, backend: AttentionBackend,
                 shared: bool = True) -> None:
        self.kv = kv
        self.model = model
        self.backend = backend
        self.shared = shared  # False: every sequence computes its own copy (caching off)
        self.computed_blocks = 0  # blocks whose K/V this engine computed (misses)
        self.reused_blocks = 0  # blocks a sequence took from the tree (hits)

    def _keys(self, image: SeqImage) -> np.ndarray:
        bs = self.kv.block_size
        padded = -(-image.placement.xattn_tokens // bs) * bs
        return make_keys(np.zeros(padded, dtype=np.int64), [ImageSpan(0, padded, image.image.uid)])

    def _namespace(self, seq: Sequence) -> bytes:
        own = b"" if self.shared else b"|seq:%d" % seq.seq_id
        return b"xattn|" + seq.namespace + own

    def needs_encoding(self, seq: Sequence) -> list[SeqImage]:
        """The images of ``seq`` whose K/V ``acquire`` would compute now (some of their tokens'
        blocks are not in the tree), so whose encoder output it would read."""
        return [image for image in seq.images
                if self.kv.tree.cached_length(self._keys(image), self._namespace(seq))
                < image.placement.xattn_tokens]

    def acquire(self, seq: Sequence) -> bool:
        """Reference (computing where missing) the K/V of every image of ``seq``; False, holding
        nothing, when the pool cannot take them now. Every image's cached blocks are referenced
        before any is computed (so computing one evicts none of the others), and an image that
        appears twice shares its first copy's blocks: exactly the images ``needs_encoding`` named
        read the encoder output."""
        namespace, bs = self._namespace(seq), self.kv.block_size
        tables = [self.kv.acquire_prefix(self._keys(image), namespace) for image in seq.images]
        first: dict[int, int] = {}  # uid -> where it first appears in seq.images
        hits = 0  # whole blocks taken from the tree
        try:
            for i, image in enumerate(seq.images):
                j = first.setdefault(image.image.uid, i)
                if j != i:
                    self.kv.free(tables[i])
                    tables[i] = self.kv.fork(tables[j])
                    hits += len(tables[i].blocks)
                    continue
                table, keys = tables[i], self._keys(image)
                hits += table.num_tokens // bs
                missing = keys.shape[0] - table.num_tokens
                if missing and self.kv.blocks_needed(table, missing) > self.kv.num_available():
                    self._free(tables)
                    return False
                if missing:
                    start = table.num_tokens
                    self.kv.append_slots(table, missing)
                    self._write(image, table, start)
                    seq.reuse.xattn_blocks_computed += len(table.blocks) - start // bs
                    cost = self.model.image_rebuild_flops(image.placement) / len(table.blocks)
                    self.kv.cache_prefix(table, keys, namespace, cost)
        except BaseException:  # computing the K/V raised: hold nothing
            self._free(tables)
            raise
        seq.image_tables = tables
        self.reused_blocks += hits
        return True

    def _free(self, tables: list[BlockTable]) -> None:
        for table in tables:
            self.kv.free(table)

    def release(self, seq: Sequence) -> None:
        for table in seq.image_tables:
            self.kv.free(table)
        seq.image_tables = []

    def _write(self, image: SeqImage, table: BlockTable, start: int) -> None:
        n = image.placement.xattn_tokens
        if start >= n:
            return
        layers = self.model.layer_views(self.kv.storage.stores[0])
        embeddings = self.model.vision.embeddings(image.image)
        for idx, (k, v) in zip(self.model.cross_layers, self.model.xattn_kv(embeddings)):
            self.backend.write_image_kv(layers[idx], table.blocks, start, k[start:n], v[start:n])
        self.computed_blocks += len(table.blocks) - start // self.kv.block_size
