"""The recorded FlashInfer signatures (``flashinfer_api.json``) against the installed package.

CI binds mmkv's calls against the record (FlashInfer is not installed there); wherever
flashinfer-python is installed (a developer's machine, the GPU host) this test proves the record
is the package's.
"""

import pytest

from flashinfer_api import RECORD, TARGETS, live, recorded
from mmkv.attention.flashinfer_backend import VERSION


def test_the_record_covers_every_target_of_the_version_the_backend_is_written_for():
    record = recorded()
    assert record["version"] == VERSION
    assert set(record["signatures"]) == set(TARGETS)


def test_the_record_is_the_installed_package():
    flashinfer = pytest.importorskip("flashinfer", reason="flashinfer-python is not installed")
    if flashinfer.__version__ != VERSION:
        pytest.skip(f"flashinfer {flashinfer.__version__} is installed; the record is of {VERSION}")
    assert live() == recorded()["signatures"], f"re-record with: python tests/flashinfer_api.py --write ({RECORD})"
