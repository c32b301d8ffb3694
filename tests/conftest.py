"""Shared fixtures. Every BlockPool and RadixTree built during a test is checked afterwards."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from cache.block_pool import BlockPool
from cache.radix_tree import RadixTree

sys.path.insert(0, str(Path(__file__).parent))


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


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, "Path"]:
    """One tiny random checkpoint per supported family (built once per test session)."""
    from tiny_models import FAMILIES, build_model, save_byte_tokenizer

    root = tmp_path_factory.mktemp("models")
    dirs = {name: build_model(name, root / name) for name in FAMILIES}
    save_byte_tokenizer(dirs["llama"])
    return dirs


@pytest.fixture(scope="session")
def hf_oracle(model_dirs):
    """Greedy continuation by transformers' generate (fp32), memoised."""
    from tiny_models import hf_greedy, load_hf

    models: dict[str, object] = {}
    memo: dict[tuple, list[int]] = {}

    def oracle(family: str, prompt: list[int], max_new_tokens: int) -> list[int]:
        key = (family, tuple(prompt), max_new_tokens)
        if key not in memo:
            if family not in models:
                models[family] = load_hf(model_dirs[family])
            memo[key] = hf_greedy(models[family], prompt, max_new_tokens)
        return memo[key]

    return oracle


@pytest.fixture(scope="session")
def vlm_dirs(tmp_path_factory) -> dict[str, "Path"]:
    """Tiny random Mllama, LLaVA and mmkv_vlm checkpoints (built once per test session)."""
    from tiny_vlms import build_llava, build_mllama, build_mmkv_vlm

    root = tmp_path_factory.mktemp("vlms")
    return {"mllama": build_mllama(root / "mllama"), "llava": build_llava(root / "llava"),
            "mmkv_vlm": build_mmkv_vlm(root / "mmkv_vlm")}
