"""Host lists of integers as tensors, for the metadata and token ids every step builds.

They are built through numpy (``np.array``, then ``torch.from_numpy``, which shares its memory):
on the CPU ``torch.tensor`` costs more a call however short the list, and a decode step builds a
dozen short arrays. The figures: docs/attention-and-kernels.md (Host-side step work).
"""

from __future__ import annotations

import numpy as np
import torch


def host_ints(values: list, dtype: type = np.int32) -> torch.Tensor:
    """A host tensor of ``values`` (a list, or a list of equal-length lists) in ``dtype``."""
    return torch.from_numpy(np.array(values, dtype=dtype))


def longs(values: list, device: torch.device) -> torch.Tensor:
    """``values`` as a long tensor on ``device``."""
    return host_ints(values, np.int64).to(device)
