"""The C heap's free memory, handed back to the operating system.

Loading a model frees many layer-sized tensors in the middle of the heap (float weights read and
quantized, weights packed or fused into new copies). glibc keeps such freed pages resident unless
asked to return them; ``release_free_heap`` asks (``malloc_trim``), and is a no-op on other C
libraries.
"""

from __future__ import annotations

import ctypes
import functools


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


def release_free_heap() -> None:
    """Return the heap's free pages (after loading a quantized model they were about a fifth of
    its weights' bytes more: ``python -m mmkv.bench weights``' ``load_rss_*``)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
