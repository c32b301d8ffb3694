"""``mmkv.heap.release_free_heap``: with ``grown_by`` it trims only once the process's resident
memory has grown by that much since the last trim (an engine going idle after every short request
would otherwise fault its step memory in again each time); without, it always trims."""

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


def test_resident_bytes_reads_this_process():
    before = heap.resident_bytes()
    block = b"\x01" * (64 << 20)  # written, so resident
    assert heap.resident_bytes() - before >= 48 << 20
    del block
