"""``mmkv.heap.release_free_heap``: with ``grown_by`` it trims only once the process's resident
memory has grown by that much since the last trim (an engine going idle after every short request
would otherwise fault its step memory in again each time); without, it always trims."""

import subprocess
import sys
import textwrap
from pathlib import Path

from mmkv import heap


def test_a_trim_with_a_threshold_waits_for_that_much_growth_since_the_last(monkeypatch):
    trims, resident = [], [100 << 20]
    monkeypatch.setattr(heap, "_malloc_trim", lambda: lambda pad: trims.append(resident[0]))
    monkeypatch.setattr(heap, "resident_bytes", lambda: resident[0])
    monkeypatch.setattr(heap, "_after_last_trim", [0])
    heap.release_free_heap(grown_by=16 << 20)  # no trim yet: everything is growth
    assert trims == [100 << 20]
    for grown, trimmed in ((15 << 20, 1), (1 << 20, 2), (8 << 20, 2), (-32 << 20, 2)):
        resident[0] += grown
        heap.release_free_heap(grown_by=16 << 20)
        assert len(trims) == trimmed, (grown, trims)
    heap.release_free_heap()  # no threshold: always
    assert len(trims) == 3


def test_resident_bytes_counts_pages_once_written_not_once_mapped():
    """In a fresh interpreter, where no other thread allocates or trims: 64 MiB mapped add
    little resident memory, and add all of it once every page is written."""
    script = textwrap.dedent("""
        import mmap
        from mmkv import heap
        before = heap.resident_bytes()
        block = mmap.mmap(-1, 64 << 20)
        mapped = heap.resident_bytes()
        block.write(b"\\x01" * (64 << 20))
        print(mapped - before, heap.resident_bytes() - mapped)
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parent.parent)
    mapped, written = map(int, run.stdout.split())
    assert mapped < 16 << 20 and written >= 60 << 20, (mapped, written)
