"""Building and loading the native kernel library (``mmkv.native``): the file's mode, the rebuild of
an unusable cached library, the refusal of caches other users could write into.

Every test builds into its own ``MMKV_NATIVE_CACHE`` (and its own temporary directory, where a
refused cache's private build goes), and forgets the loaded library and the callers' lookups
before and after, so the other tests' kernels come from the usual cache again. The module compiles
the sources once for real (``built_once``); each test's builds then run ``CC``'s stand-in, which
writes empty objects and links by copying that library, so every step of ``_build`` but the
compiler itself (its directory, mode, check and rename) runs in seconds instead of a compile each."""

import ctypes
import logging
import os
import shutil
import stat
import subprocess
import tempfile

import pytest
import torch

from mmkv import native as native_library
from mmkv import sampler
from mmkv.attention import native


def forget_library() -> None:
    native_library.library.cache_clear()
    native.kernel.cache_clear()
    sampler.top_tokens_kernel.cache_clear()


STAND_IN_COMPILER = """#!/bin/sh
out=; previous=
for arg in "$@"; do [ "$previous" = -o ] && out=$arg; previous=$arg; done
case " $* " in *" -c "*) : > "$out" ;; *) cp "{library}" "$out" ;; esac
"""


@pytest.fixture(scope="module")
def built_once(tmp_path_factory):
    """The library compiled from the sources, by the real compiler, in a cache of its own."""
    root = tmp_path_factory.mktemp("built-once")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MMKV_NATIVE_CACHE", str(root))
        patch.delenv("MMKV_NATIVE", raising=False)
        patch.delenv("CC", raising=False)
        forget_library()
        assert_kernels_work(native_library.library())
        path = native_library._library_path()
    forget_library()
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch, built_once):
    """The cache directory (not yet created) the library is built in; ``tmp_path / "tmp"`` is the
    system's temporary directory meanwhile, and ``CC`` the stand-in linking ``built_once``."""
    (tmp_path / "tmp").mkdir()
    compiler = tmp_path / "cc"
    compiler.write_text(STAND_IN_COMPILER.format(library=built_once))
    compiler.chmod(0o755)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.setenv("MMKV_NATIVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(compiler))
    monkeypatch.delenv("MMKV_NATIVE", raising=False)
    forget_library()
    yield tmp_path / "cache"
    forget_library()


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def assert_kernels_work(lib) -> None:
    """Every symbol is there and a kernel computes: the top token of a few rows of logits."""
    assert lib is not None and all(hasattr(lib, name) for name in native_library.SYMBOLS)
    logits = torch.randn(3, 50)
    assert sampler.top_tokens_kernel() is not None
    assert sampler.top_tokens(logits)[0] == logits.argmax(-1).tolist()


def test_the_library_and_a_new_cache_directory_are_mode_0755(cache):
    """Whatever the umask, so other users can load a shared cache's library."""
    old = os.umask(0o077)
    try:
        lib = native_library.library()
    finally:
        os.umask(old)
    assert_kernels_work(lib)
    assert [p.name for p in cache.iterdir()] == [native_library._library_name()]  # no build leftovers
    assert mode(cache) == 0o755 and mode(native_library._library_path()) == 0o755


def test_an_unusable_cached_library_is_rebuilt_once(cache, monkeypatch, caplog):
    """Garbage, a truncated library, and a stale one lacking kernels are each rebuilt at their
    path and loaded; when the rebuild fails too, the torch paths run."""
    caplog.set_level(logging.WARNING, logger=native_library.__name__)
    cache.mkdir()
    path = native_library._library_path()
    path.write_bytes(b"not a shared library")
    stand_in = os.environ["CC"]
    monkeypatch.setenv("CC", "false")  # the rebuild fails
    assert native_library.library() is None and native.kernel() is None
    assert "rebuilding" in caplog.text and "native kernels unavailable" in caplog.text
    monkeypatch.setenv("CC", stand_in)

    forget_library()
    assert_kernels_work(native_library.library())
    assert mode(path) == 0o755
    good = path.read_bytes()

    stale = cache / "stale.c"
    stale.write_text("void mmkv_rms_norm(void) {}\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(cache / "stale.so"), str(stale)], check=True)
    for broken in (good[:len(good) // 2], (cache / "stale.so").read_bytes()):
        caplog.clear()
        replacement = cache / "replacement"
        replacement.write_bytes(broken)
        os.replace(replacement, path)  # a new file: the loaded library's pages stay mapped
        forget_library()
        assert_kernels_work(native_library.library())
        assert "rebuilding" in caplog.text and path.read_bytes() == good


def test_a_cache_others_could_write_into_is_refused(cache, caplog):
    """A world-writable directory without the sticky bit, or a group-writable library file in a
    safe one: the library is built in (or loaded from) the user's private directory instead. A
    world-writable directory with the sticky bit is used."""
    caplog.set_level(logging.WARNING, logger=native_library.__name__)
    private = cache.parent / "tmp" / f"mmkv-native-{os.getuid()}"
    cache.mkdir()
    os.chmod(cache, 0o777)
    assert_kernels_work(native_library.library())
    assert "world-writable without the sticky bit" in caplog.text
    assert list(cache.iterdir()) == [] and mode(private) == 0o700
    built = private / native_library._library_name()
    assert mode(built) == 0o755

    caplog.clear()
    os.chmod(cache, 0o755)
    shutil.copy(built, cache / built.name)
    os.chmod(cache / built.name, 0o775)
    forget_library()
    lib = native_library.library()
    assert_kernels_work(lib)
    assert "group- or world-writable" in caplog.text and lib._name == str(built)

    caplog.clear()
    (cache / built.name).unlink()
    os.chmod(cache, 0o1777)
    forget_library()
    assert_kernels_work(native_library.library())
    assert caplog.text == "" and (cache / built.name).exists()


def test_without_the_library_no_caller_gets_a_kernel(cache, monkeypatch):
    monkeypatch.setenv("MMKV_NATIVE", "0")
    assert native_library.library() is None
    assert native_library.function("mmkv_rms_norm", [ctypes.c_void_p]) is None
    assert native.kernel() is None and sampler.top_tokens_kernel() is None
    assert not cache.exists()
