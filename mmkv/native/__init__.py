"""mmkv's native CPU kernels: the C files beside this module, built into one library.

Each kernel replaces a run of small tensor operations whose dispatch costs more than their
arithmetic on decode rows: ``paged_decode.c`` attends a decode batch over the paged KV cache in
place (``mmkv.attention.native``), ``rms_norm.c`` normalises float32 rows in one call
(``mmkv.models.fused_layer.RMSNorm``: torch's ``rms_norm`` is six kernels on the CPU),
``rope_write.c`` rotates a fused layer's queries and keys and stores its K/V at the step's write
slots, ``top_tokens.c`` finds each row's argmax and its probability for greedy decoding and
drafting (``mmkv.sampler.top_tokens``), and ``quantized_linear.c`` multiplies a few rows by an int8
or int4 weight (or int8 in groups), decoding it in registers (``mmkv.quantization.linear``). What each measured:
docs/attention-and-kernels.md.

Building. The library is compiled on first use (a CPU engine asks for it when it starts) with the
machine's C compiler (``-O3 -march=native -fopenmp``, OpenMP being the runtime torch's CPU build
already loads; each source in a compiler process of its own, side by side, then linked) into
``~/.cache/mmkv/native`` (or ``$MMKV_NATIVE_CACHE``), under a name that hashes
the sources (headers included), the flags and the CPU, and loaded with ``ctypes``. A cache
directory mmkv creates is mode 0755 whatever the umask. The compiler writes into a fresh private
(0700) directory inside the cache directory; the result is made mode 0755 (readable and
executable by every user, writable by its owner, so one cache can serve several users), loaded and
checked there, and only then renamed over the library's name, so concurrent first uses never load
a half-written library.

Checked load. A library is used only when it is whole (an ELF file no shorter than its headers
say: ``dlopen`` faults on a truncated one instead of failing), loads, and exports every kernel the
callers use (``SYMBOLS``). A cached library that fails any of these (corrupt, truncated, stale) is
rebuilt once under a fresh name, checked the same way and renamed over it; if that fails too,
``library()`` is ``None`` (with a warning) and the torch paths run.

Refusal rule. Loading a library runs its code, so mmkv refuses a cache directory that any user may
write into (world-writable without the sticky bit), and a cached library file that is not a regular
file, is group- or world-writable, or is owned by anyone but the current user, the directory's
owner or root (a file the directory's owner wrote adds no one to trust: they control the
directory). It logs why and builds in, or loads from, this user's private directory instead:
``mmkv-native-<uid>`` under the system's temporary directory (``tempfile.gettempdir()``), created
mode 0700 (reset to 0700 when this user owns it). Where that path is not a directory of this user's,
or holds a refused file, ``library()`` is ``None`` and the torch paths run.

Checked inputs. The kernels trust their page ids, lengths and slots: a metadata bug would be a
silent access outside the KV cache. With ``StepContext.check_bounds`` (every step of an
``Engine(debug=True)``), each call that reads or writes pages or slots first checks them:
``check_pages`` (every page id ``0 <= id < num_blocks``, every length ``0 <= lens[i] <=
pages.shape[1] * block_size``) before ``paged_decode.c`` reads them, ``check_slots`` (every write
slot ``0 <= slot < num_blocks * 2 * block_size``, the layer's rows of K or V) before
``rope_write.c`` writes them, and the arrays' dtypes and shapes; a bad one raises ``IndexError``
(an id outside the layer) or ``ValueError`` (a length its pages cannot hold, a wrong dtype or
shape) naming the entry and the bound, and the kernel is not called. Without ``check_bounds``
nothing is checked and no tensor is reduced.

Invariant: a caller gets a kernel only from ``function``, which is ``None`` whenever the library
is, so the torch path is always the fallback; ``MMKV_NATIVE=0`` disables every kernel. (``library``
is cached: a test that changes ``MMKV_NATIVE``, the flags or the cache clears it with
``library.cache_clear()`` and its callers' cached lookups, ``mmkv.attention.native.kernel`` and
``mmkv.sampler.top_tokens_kernel``; fused layers and norms look their kernels up when built.)
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import stat
import struct
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCES = tuple(sorted(Path(__file__).parent.glob("*.c")))
HEADERS = tuple(sorted(Path(__file__).parent.glob("*.h")))  # included by the sources
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC")
SYMBOLS = ("mmkv_paged_decode", "mmkv_rms_norm", "mmkv_rope_write", "mmkv_top_tokens",
           "mmkv_int8_linear", "mmkv_int4_linear", "mmkv_int8_linear_bf16", "mmkv_int4_linear_bf16",
           "mmkv_int8_dequantize", "mmkv_int4_dequantize", "mmkv_int8_dequantize_bf16",
           "mmkv_int4_dequantize_bf16", "mmkv_int8_group_linear", "mmkv_int8_group_linear_bf16",
           "mmkv_int8_group_dequantize",
           "mmkv_int8_group_dequantize_bf16", "mmkv_amx_rows")

log = logging.getLogger(__name__)


class Refused(OSError):
    """A cache directory or library file that other users could have written."""


def _cpu_signature() -> str:
    """What ``-march=native`` compiles for: the CPU's model and feature flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(lines))


def _library_name() -> str:
    code = b"".join(s.read_bytes() for s in SOURCES + HEADERS)
    digest = hashlib.sha256(code + " ".join(FLAGS).encode() + _cpu_signature().encode()).hexdigest()[:16]
    return f"mmkv-kernels-{digest}.so"


def _cache_root() -> Path:
    return Path(os.environ.get("MMKV_NATIVE_CACHE") or Path.home() / ".cache" / "mmkv" / "native")


def _library_path() -> Path:
    """Where the library is cached (``$MMKV_NATIVE_CACHE`` or the user's cache)."""
    return _cache_root() / _library_name()


def _private_root() -> Path:
    """This user's own build directory (mode 0700), for when the cache is refused."""
    root = Path(tempfile.gettempdir()) / f"mmkv-native-{os.getuid()}"
    try:
        root.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise Refused(f"{root} must be a directory owned by uid {os.getuid()} (found "
                      f"{stat.filemode(st.st_mode)} owned by uid {st.st_uid})")
    if st.st_mode & 0o077:
        os.chmod(root, 0o700)
    return root


def _make_directory(root: Path) -> None:
    """Create ``root`` (and its parents) if missing, ``root`` itself mode 0755 whatever the umask."""
    if root.is_dir():
        return
    root.parent.mkdir(parents=True, exist_ok=True)
    try:
        root.mkdir(mode=0o755)
    except FileExistsError:
        return
    os.chmod(root, 0o755)


def _directory_refusal(root: Path) -> str | None:
    """Why ``root`` may not hold a library mmkv loads, or ``None``."""
    mode = os.stat(root).st_mode
    if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
        return (f"cache directory {root} is world-writable without the sticky bit "
                f"(mode {stat.filemode(mode)}); allowed: not world-writable, or sticky")
    return None


def _file_refusal(path: Path) -> str | None:
    """Why the cached library ``path`` may not be loaded, or ``None`` (also when it is absent)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    trusted = {os.getuid(), os.stat(path.parent).st_uid, 0}
    if not stat.S_ISREG(st.st_mode):
        return f"cached library {path} is not a regular file"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (f"cached library {path} is group- or world-writable (mode "
                f"{stat.filemode(st.st_mode)}); allowed: writable by its owner only")
    if st.st_uid not in trusted:
        return (f"cached library {path} is owned by uid {st.st_uid}; allowed: this user, the "
                f"directory's owner or root ({sorted(trusted)})")
    return None


def _elf_shortfall(path: Path) -> str | None:
    """Why the ELF file at ``path`` is shorter than its own headers say, or ``None``. ``dlopen``
    maps a truncated library's segments past the file's end and faults on them (SIGBUS) instead
    of failing, so such a file is never handed to it. Files that are not ELF pass (``dlopen``
    rejects those cleanly)."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF":
        return None
    try:
        order = "<" if data[5] == 1 else ">"
        if data[4] == 2:  # 64-bit: e_phoff, e_shoff; e_phentsize, e_phnum, e_shentsize, e_shnum
            phoff, shoff = struct.unpack_from(order + "QQ", data, 32)
            phsize, phnum, shsize, shnum = struct.unpack_from(order + "4H", data, 54)
            segment, at = order + "Q16xQ", 8  # p_offset, p_filesz
        else:
            phoff, shoff = struct.unpack_from(order + "II", data, 28)
            phsize, phnum, shsize, shnum = struct.unpack_from(order + "4H", data, 42)
            segment, at = order + "I8xI", 4
        need = max(phoff + phnum * phsize, shoff + shnum * shsize)
        for i in range(phnum):
            offset, size = struct.unpack_from(segment, data, phoff + i * phsize + at)
            need = max(need, offset + size)
    except (struct.error, IndexError):
        return f"it is truncated ({len(data)} bytes, too short for its ELF headers)"
    if len(data) < need:
        return f"it is truncated ({len(data)} bytes where its ELF headers need {need})"
    return None


def _checked_load(path: Path) -> tuple[ctypes.CDLL | None, str]:
    """The library at ``path`` if it is whole, loads and exports every name in ``SYMBOLS``, else
    ``None`` and why not."""
    if (why := _elf_shortfall(path)):
        return None, why
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as err:
        return None, f"it does not load ({err})"
    missing = [name for name in SYMBOLS if not hasattr(lib, name)]
    if missing:
        return None, f"it lacks {', '.join(missing)}"
    return lib, ""


def _build(target: Path) -> ctypes.CDLL:
    """Compile into a fresh private directory beside ``target``, make the result mode 0755, load
    and check it there, then rename it over ``target``; raises when any step fails."""
    compiler = os.environ.get("CC", "cc")
    work = Path(tempfile.mkdtemp(prefix=".mmkv-build-", dir=target.parent))
    try:
        partial = work / target.name
        objects = [work / f"{source.stem}.o" for source in SOURCES]
        compile_flags = [flag for flag in FLAGS if flag != "-shared"]
        _run_side_by_side([[compiler, *compile_flags, "-c", "-o", str(obj), str(source)]
                           for source, obj in zip(SOURCES, objects)])
        _run_side_by_side([[compiler, *FLAGS, "-o", str(partial), *map(str, objects), "-lm"]])
        os.chmod(partial, 0o755)
        lib, why = _checked_load(partial)
        if lib is None:
            raise OSError(f"the library built from {', '.join(s.name for s in SOURCES)} is unusable: {why}")
        os.replace(partial, target)
        return lib
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run_side_by_side(commands: list[list[str]], timeout: float = 120) -> None:
    """Run the compiler commands at once (a source each, so every core compiles); raises
    ``CalledProcessError`` (with the compiler's output) for the first that fails."""
    running = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for command in commands]
    try:
        for command, process in zip(commands, running):
            output, _ = process.communicate(timeout=timeout)
            if process.returncode:
                raise subprocess.CalledProcessError(process.returncode, command, output, output)
    finally:
        for process in running:
            if process.poll() is None:
                process.kill()
                process.wait()


def _load_or_build() -> ctypes.CDLL:
    root = _cache_root()
    _make_directory(root)
    path = root / _library_name()
    refusal = _directory_refusal(root) or _file_refusal(path)
    if refusal:
        root = _private_root()
        log.warning("mmkv: %s; using %s for the native kernels instead", refusal, root)
        path = root / path.name
        if (refusal := _file_refusal(path)):
            raise Refused(refusal)
    if path.exists():
        lib, why = _checked_load(path)
        if lib is not None:
            return lib
        log.warning("mmkv: cached native library %s is unusable (%s); rebuilding it", path, why)
    return _build(path)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, checked to export ``SYMBOLS``, or ``None`` (disabled, or no usable
    library could be built)."""
    if os.environ.get("MMKV_NATIVE", "1") == "0":
        return None
    try:
        return _load_or_build()
    except (OSError, subprocess.SubprocessError) as err:
        detail = getattr(err, "stderr", None) or err
        log.warning("mmkv: native kernels unavailable, using the torch paths (%s)", detail)
        return None


def function(name: str, argtypes: list, restype=ctypes.c_int) -> ctypes._CFuncPtr | None:
    """The kernel ``name`` (one of ``SYMBOLS``) with its C signature, or ``None`` where
    ``library()`` is."""
    lib = library()
    if lib is None:
        return None
    kernel = getattr(lib, name)
    kernel.argtypes, kernel.restype = argtypes, restype
    return kernel


def check_index_shape(name: str, ids: torch.Tensor, shape: tuple[int | None, ...]) -> None:
    """``ids`` must be a contiguous int64 CPU tensor of ``shape`` (``None``: any size): what the
    kernels read (``ValueError`` naming ``name`` otherwise)."""
    if ids.dtype != torch.int64 or ids.device.type != "cpu":
        raise ValueError(f"{name} must be an int64 CPU tensor (the kernels read int64), "
                         f"got {ids.dtype} on {ids.device}")
    if not ids.is_contiguous():
        raise ValueError(f"{name} must be contiguous (the kernels read it as a flat array)")
    if ids.dim() != len(shape) or any(want is not None and got != want
                                      for got, want in zip(ids.shape, shape)):
        wanted = ", ".join("any" if s is None else str(s) for s in shape)
        raise ValueError(f"{name} has shape {tuple(ids.shape)}; the call needs [{wanted}]")


def _first_outside(name: str, ids: torch.Tensor, low: int, end: int, error: type[Exception],
                   what: str, allowed: str) -> None:
    """Raise ``error`` naming the first entry of ``ids`` outside ``low <= id < end``."""
    bad = (ids < low) | (ids >= end)
    if bool(bad.any()):
        at = tuple(bad.nonzero()[0].tolist())
        raise error(f"{name}[{', '.join(map(str, at))}] = {int(ids[at])} is outside {what} "
                    f"(allowed {allowed})")


def check_pages(layer: torch.Tensor, pages: torch.Tensor, lens: torch.Tensor) -> None:
    """Before a kernel reads ``lens[i]`` keys from the pages ``pages[i]`` of a cache ``layer``
    ``[num_blocks, 2, block_size, kv_heads, head_dim]``: every page id must name one of the
    layer's blocks (``IndexError`` otherwise) and every length fit in its row of pages
    (``0 <= lens[i] <= pages.shape[1] * block_size``, ``ValueError`` otherwise)."""
    num_blocks, block_size = layer.shape[0], layer.shape[2]
    check_index_shape("pages", pages, (None, None))
    check_index_shape("lens", lens, (pages.shape[0],))
    _first_outside("pages", pages, 0, num_blocks, IndexError,
                   f"the cache layer's {num_blocks} blocks", f"0 <= page id < {num_blocks}")
    capacity = pages.shape[1] * block_size
    _first_outside("lens", lens, 0, capacity + 1, ValueError,
                   f"what its {pages.shape[1]} pages of {block_size} slots hold",
                   f"0 <= length <= {capacity}")


def check_slots(layer: torch.Tensor, slots: torch.Tensor, count: int) -> None:
    """Before a kernel writes ``count`` rows at ``slots`` of a cache ``layer`` viewed as rows of
    ``kv_heads x head_dim`` (``num_blocks * 2 * block_size`` rows: each block's keys, then its
    values; ``PagedBatch.write_slots``): ``slots`` must hold ``count`` int64 entries
    (``ValueError`` otherwise), each a row of the layer (``IndexError`` otherwise)."""
    rows = layer.shape[0] * layer.shape[1] * layer.shape[2]
    check_index_shape("write_slots", slots, (count,))
    _first_outside("write_slots", slots, 0, rows, IndexError,
                   f"the cache layer's {rows} rows ({layer.shape[0]} blocks x {layer.shape[1]} "
                   f"x {layer.shape[2]} slots)", f"0 <= slot < {rows}")
