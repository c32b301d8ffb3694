"""Physical KV memory: one paged tensor per layer on the device, plus a host tier.

Layout per layer is FlashInfer's NHD paged format ``[num_blocks, 2, block_size, num_kv_heads,
head_dim]`` (index 0 of dim 1 is K, 1 is V). Block ids index dim 0 of every layer at once. The host
tier has the same layout in CPU memory (pinned when CUDA is present) and holds swapped-out blocks.
Each layer has its own storage dtype (``cache.kv_format``: the model's, int8 with each row's scale
in the row's last bytes, or fp8), so a compressed layer's scales are part of its blocks.

Guarantees: copies and swaps move every layer's K and V of the slots they name bit for bit,
scales included.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

import torch

from cache.kv_format import row_width

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(size: str | int) -> int:
    """``"2GiB"`` / ``"512MB"`` / ``1 << 30`` -> bytes."""
    if isinstance(size, int):
        value = size
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", size)
        if m is None or m.group(2).upper() not in _UNITS:
            raise ValueError(f"memory size must look like '2GiB', '512MB' or an integer, got {size!r}")
        value = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if value <= 0:
        raise ValueError(f"memory size must be positive, got {size!r}")
    return value


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of one model's KV cache and each layer's storage dtype (``layer_dtypes``, default
    ``dtype`` for every layer): with the model, a cache's identity, so blocks never move between
    caches of different layouts."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    dtype: torch.dtype = torch.float32
    layer_dtypes: tuple[torch.dtype, ...] | None = None

    def dtype_of(self, layer: int) -> torch.dtype:
        """The storage dtype of layer ``layer``."""
        return self.dtype if self.layer_dtypes is None else self.layer_dtypes[layer]

    def layer_shape(self, layer: int) -> tuple[int, ...]:
        """One block of layer ``layer``: ``(2, block_size, kv_heads, row width)``."""
        return 2, self.block_size, self.num_kv_heads, row_width(self.dtype_of(layer), self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block over every layer, scales included."""
        total = 0
        for i in range(self.num_layers):
            elem = torch.empty((), dtype=self.dtype_of(i)).element_size()
            total += elem * torch.Size(self.layer_shape(i)).numel()
        return total


class KVStorage:
    """Per-layer paged KV tensors on ``device`` and a host tier of ``num_host_blocks`` slots.

    ``extra_layouts`` add further stores addressed by the same block ids (a draft model's K/V next
    to its target's: one block table, two physical stores). Copies, swaps and moves act on every
    store, so a block means the same positions in all of them (a copy of a block's first slots
    may copy fewer of the extra stores', those they hold current).
    """

    def __init__(self, layout: KVLayout, num_blocks: int, device: str | torch.device = "cpu",
                 num_host_blocks: int = 0, extra_layouts: Sequence[KVLayout] = ()) -> None:
        self.layouts = [layout, *extra_layouts]
        if any(lay.block_size != layout.block_size for lay in self.layouts):
            raise ValueError("every store of one cache must use the same block size")
        self.layout = layout
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        pin = torch.cuda.is_available()
        self.stores: list[list[torch.Tensor]] = []
        self.host: list[torch.Tensor] = []
        for lay in self.layouts:
            self.stores.append([torch.zeros((num_blocks, *lay.layer_shape(i)), dtype=lay.dtype_of(i),
                                            device=self.device) for i in range(lay.num_layers)])
            self.host += [torch.zeros((num_host_blocks, *lay.layer_shape(i)), dtype=lay.dtype_of(i),
                                      pin_memory=pin) for i in range(lay.num_layers)]
        self.layers = [t for store in self.stores for t in store]

    @property
    def bytes_per_block(self) -> int:
        return sum(lay.bytes_per_block for lay in self.layouts)

    @property
    def device_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def copy_blocks(self, src: list[int], dst: list[int], num_tokens: int | None = None,
                    extra_tokens: int | None = None) -> None:
        """Copy blocks ``src[i] -> dst[i]`` in every layer (only the first ``num_tokens`` slots if
        given: token-exact reuse of a partially matching block; in the extra stores only the
        first ``extra_tokens`` if given, what they hold current: none while a draft model has
        not run, so its store is not copied at all)."""
        if not src:
            return
        s = torch.tensor(src, device=self.device)
        d = torch.tensor(dst, device=self.device)
        for i, store in enumerate(self.stores):
            slots = num_tokens if i == 0 or extra_tokens is None else extra_tokens
            if slots == 0:
                continue
            for layer in store:
                if slots is None:
                    layer[d] = layer[s]
                else:
                    layer[d, :, :slots] = layer[s, :, :slots]

    def move_blocks(self, mapping: dict[int, int]) -> None:
        """Compaction: data of each ``old`` block ends up in ``new``."""
        self.copy_blocks(list(mapping), list(mapping.values()))

    def resize(self, num_blocks: int) -> None:
        """Reallocate every device store for ``num_blocks`` blocks, keeping the data of the
        blocks both sizes hold (the first ``min(old, new)``)."""
        keep = min(num_blocks, self.num_blocks)
        for store in self.stores:
            for i, layer in enumerate(store):
                fresh = torch.zeros((num_blocks, *layer.shape[1:]), dtype=layer.dtype, device=self.device)
                fresh[:keep] = layer[:keep]
                store[i] = fresh
        self.layers = [t for store in self.stores for t in store]
        self.num_blocks = num_blocks

    def swap_out(self, blocks: list[int], host_slots: list[int]) -> None:
        """Device blocks -> host slots."""
        if not blocks:
            return
        d = torch.tensor(blocks, device=self.device)
        h = torch.tensor(host_slots)
        staged = [layer[d].to("cpu", non_blocking=True) for layer in self.layers]
        if self.device.type == "cuda":  # the copies above are asynchronous: wait before reading
            torch.cuda.synchronize(self.device)
        for host, data in zip(self.host, staged):
            host[h] = data

    def swap_in(self, host_slots: list[int], blocks: list[int]) -> None:
        """Host slots -> device blocks."""
        if not blocks:
            return
        d = torch.tensor(blocks, device=self.device)
        h = torch.tensor(host_slots)
        for layer, host in zip(self.layers, self.host):
            layer[d] = host[h].to(self.device, non_blocking=True)
