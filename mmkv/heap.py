"""The C heap's free memory, handed back to the operating system.

Loading a model frees many layer-sized tensors in the middle of the heap (float weights read and
quantized, weights packed or fused into new copies). glibc keeps such freed pages resident unless
asked to return them; ``release_free_heap`` asks (``malloc_trim``), and is a no-op on other C
libraries. Trimming has a price: the pages it returns fault in again when the next step reuses
them. So a caller that may trim often (an engine going idle after each request) passes
``grown_by``: the trim runs only where the process's resident memory grew by that much since the
last one (the steps since then left that much to hand back, at most), read from
``/proc/self/statm`` (where that is missing, it always trims).

Invariant: after a call with ``grown_by``, the process holds less than ``grown_by`` bytes more
than just after the last trim, or it has just trimmed.
"""

from __future__ import annotations

import ctypes
import functools
import os

_after_last_trim: list[int] = [0]  # resident bytes just after the last trim (0: none yet)


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


def resident_bytes() -> int | None:
    """The process's resident memory (None where ``/proc`` does not say)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def release_free_heap(grown_by: int = 0) -> None:
    """Return the heap's free pages (after loading a quantized model they were about a fifth of
    its weights' bytes more: ``python -m mmkv.bench weights``' ``load_rss_*``); with ``grown_by``,
    only if the resident memory grew by at least that much since the last trim."""
    trim = _malloc_trim()
    if trim is None:
        return
    if grown_by and (resident := resident_bytes()) is not None and resident - _after_last_trim[0] < grown_by:
        return
    trim(0)
    _after_last_trim[0] = resident_bytes() or 0
