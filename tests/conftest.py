"""Shared fixtures. Every BlockPool and RadixTree built during a test is checked afterwards."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from cache.block_pool import BlockPool
from cache.radix_tree import RadixTree

sys.path.insert(0, str(Path(__file__).parent))

# The suite's xdist workers share the machine's cores: each runs torch on its share of them. An
# OpenMP team spanning every core while another worker's team wants them too waits at each barrier
# for a thread the OS scheduled out (a test took five times as long beside the other worker).
CORES = torch.get_num_threads()
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(max(1, CORES // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


@pytest.fixture
def every_core():
    """torch on every core of the machine for the test (an xdist worker runs on its share),
    its share back after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(CORES)
    yield CORES
    torch.set_num_threads(threads)


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


@pytest.fixture(scope="module")
def ray_cluster(request: pytest.FixtureRequest):
    """A local Ray cluster for the module (2 CPUs, no dashboard, a 256 MiB object store), shut down
    after it. Its modules are marked ``xdist_group("ray")``, which under ``--dist loadgroup`` (the
    suite's default) sends them all to one worker, one cluster at a time: xdist names each such
    test with its group (``...@ray``), and a test without that name (a pytest whose node ids xdist
    cannot rename) means both workers would start clusters at once."""
    import ray

    if getattr(request.config.option, "loadgroup", False):  # an xdist worker scheduling by group
        ungrouped = [item.nodeid for item in request.session.items
                     if item.get_closest_marker("xdist_group") and "@" not in item.nodeid]
        assert not ungrouped, (f"pytest-xdist did not name {ungrouped[0]} with its xdist_group under "
                               f"pytest {pytest.__version__}: the Ray modules would run in both workers")
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=256 * 1024**2, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, "Path"]:
    """One tiny random checkpoint per supported family (built once per test session)."""
    from tiny_models import FAMILIES, build_model, save_byte_tokenizer

    root = tmp_path_factory.mktemp("models")
    dirs = {name: build_model(name, root / name) for name in FAMILIES}
    save_byte_tokenizer(dirs["llama"])
    return dirs


class Oracle:
    """transformers' greedy ``generate`` (fp32, CPU) on the tiny models, memoised; ``check``
    compares an engine's greedy output with transformers as ``devices.py`` says for the device
    under test."""

    def __init__(self, model_dirs) -> None:
        self.model_dirs = model_dirs
        self.models: dict[tuple[str, str], object] = {}
        self.memo: dict[tuple, list[int]] = {}

    def model(self, family: str, device: str = "cpu"):
        from tiny_models import load_hf

        if (family, device) not in self.models:
            self.models[family, device] = load_hf(self.model_dirs[family]).to(device)
        return self.models[family, device]

    def __call__(self, family: str, prompt: list[int], max_new_tokens: int) -> list[int]:
        from tiny_models import hf_greedy

        key = (family, tuple(prompt), max_new_tokens)
        if key not in self.memo:
            self.memo[key] = hf_greedy(self.model(family), prompt, max_new_tokens)
        return self.memo[key]

    def check(self, family: str, prompt: list[int], tokens: list[int]) -> None:
        from devices import DEVICE, assert_near_greedy

        if DEVICE == "cpu":
            assert tokens == self(family, prompt, len(tokens)), f"prompt of {len(prompt)}"
        else:
            assert_near_greedy(self.model(family, DEVICE), prompt, tokens)


@pytest.fixture(scope="session")
def hf_oracle(model_dirs) -> Oracle:
    """Greedy continuation by transformers' generate (fp32), memoised."""
    return Oracle(model_dirs)


@pytest.fixture(scope="session")
def vlm_dirs(tmp_path_factory) -> dict[str, "Path"]:
    """Tiny random Mllama, LLaVA and mmkv_vlm checkpoints (built once per test session)."""
    from tiny_vlms import build_llava, build_mllama, build_mmkv_vlm

    root = tmp_path_factory.mktemp("vlms")
    return {"mllama": build_mllama(root / "mllama"), "llava": build_llava(root / "llava"),
            "mmkv_vlm": build_mmkv_vlm(root / "mmkv_vlm")}
