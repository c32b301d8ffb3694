"""mmkv's native CPU kernels: the C files beside this module, built into one library.

Each kernel replaces a run of small tensor operations whose dispatch costs more than their
arithmetic on decode rows: ``paged_decode.c`` attends a decode batch over the paged KV cache in
place (``mmkv.attention.native``), ``rms_norm.c`` normalises float32 rows in one call
(``mmkv.models.fused_layer.RMSNorm``: torch's ``rms_norm`` is six kernels on the CPU),
``rope_write.c`` rotates a fused layer's queries and keys and stores its K/V at the step's write
slots, and ``top_tokens.c`` finds each row's argmax and its probability for greedy decoding and
drafting (``mmkv.sampler.top_tokens``). What each measured: docs/attention-and-kernels.md.

The library is compiled on first use (a CPU engine asks for it when it starts) with the machine's C
compiler (``-O3 -march=native -fopenmp``, OpenMP being the runtime torch's CPU build already loads)
into ``~/.cache/mmkv/native`` (or ``$MMKV_NATIVE_CACHE``), under a name that hashes the sources
(headers included), the flags and the CPU, and loaded with ``ctypes``. Without a compiler, or with
``MMKV_NATIVE=0``, ``library()`` is ``None`` and every caller runs its torch path: the kernels are
an optimisation, never a requirement.

Invariant: a caller gets a kernel only from ``function``, which is ``None`` whenever the library
is, so the torch path is always the fallback. (``library`` is cached: a test that changes
``MMKV_NATIVE`` or the flags clears it and its callers' cached lookups.)
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path

SOURCES = tuple(sorted(Path(__file__).parent.glob("*.c")))
HEADERS = tuple(sorted(Path(__file__).parent.glob("*.h")))  # included by the sources
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC")

log = logging.getLogger(__name__)


def _cpu_signature() -> str:
    """What ``-march=native`` compiles for: the CPU's model and feature flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(lines))


def _library_path() -> Path:
    code = b"".join(s.read_bytes() for s in SOURCES + HEADERS)
    digest = hashlib.sha256(code + " ".join(FLAGS).encode() + _cpu_signature().encode()).hexdigest()[:16]
    root = Path(os.environ.get("MMKV_NATIVE_CACHE") or Path.home() / ".cache" / "mmkv" / "native")
    return root / f"mmkv-kernels-{digest}.so"


def _compile(target: Path) -> None:
    """Build into a temporary file beside ``target`` and rename it there, so concurrent first uses
    never load a half-written library."""
    target.parent.mkdir(parents=True, exist_ok=True)
    compiler = os.environ.get("CC", "cc")
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as tmp:
        partial = Path(tmp.name)
    try:
        subprocess.run([compiler, *FLAGS, "-o", str(partial), *map(str, SOURCES), "-lm"], check=True,
                       capture_output=True, text=True, timeout=120)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or ``None`` (disabled, or they could not be built)."""
    if os.environ.get("MMKV_NATIVE", "1") == "0":
        return None
    path = _library_path()
    try:
        if not path.exists():
            _compile(path)
        return ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as err:
        detail = getattr(err, "stderr", None) or err
        log.warning("mmkv: native kernels unavailable, using the torch paths (%s)", detail)
        return None


def function(name: str, argtypes: list, restype=ctypes.c_int) -> ctypes._CFuncPtr | None:
    """The kernel ``name`` with its C signature, or ``None`` where ``library()`` is."""
    lib = library()
    if lib is None:
        return None
    kernel = getattr(lib, name)
    kernel.argtypes, kernel.restype = argtypes, restype
    return kernel
