"""Shared fixtures. Every BlockPool and RadixTree built during a test is checked afterwards."""

from __future__ import annotations

import pytest

from cache.block_pool import BlockPool
from cache.radix_tree import RadixTree


@pytest.fixture(autouse=True)
def check_block_accounting(monkeypatch: pytest.MonkeyPatch):
    """After each test, run ``check_integrity()`` on every pool and tree the test created."""
    built: list[BlockPool | RadixTree] = []
    for cls in (BlockPool, RadixTree):
        original = cls.__init__

        def recording_init(self, *args, __original=original, **kwargs):
            __original(self, *args, **kwargs)
            built.append(self)

        monkeypatch.setattr(cls, "__init__", recording_init)
    yield built
    for obj in built:
        obj.check_integrity()
