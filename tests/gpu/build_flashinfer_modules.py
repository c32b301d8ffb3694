"""Build FlashInfer's JIT modules that mmkv's backend uses, before the checks need them.

flashinfer-python ships no precompiled attention kernels: each variant is compiled with nvcc on
first use (into ~/.cache/flashinfer). The backend needs, in bfloat16: the fa2 batch-prefill module
at head_dim 64 (the tests' models) and 128 (the benchmark's) -- prefill, decode on tensor cores,
the cascade levels and cross-attention all run it -- and the page (append_paged_kv_cache),
cascade (merge_state) and quantization (the custom mask's packbits) modules. The two big ones
build side by side, then the small ones.

    python tests/gpu/build_flashinfer_modules.py                 # compile (a GPU host with nvcc)
    python tests/gpu/build_flashinfer_modules.py --sources-only  # generate and check the sources (any machine)
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")

import torch  # noqa: E402
from flashinfer.jit.attention.modules import _gen_batch_prefill_primary_module  # noqa: E402
from flashinfer.jit.cascade import gen_cascade_module  # noqa: E402
from flashinfer.jit.page import gen_page_module  # noqa: E402
from flashinfer.jit.quantization import gen_quantization_module  # noqa: E402

HEAD_DIMS = (64, 128)


def specs() -> list:
    bf16 = torch.bfloat16
    prefill = [_gen_batch_prefill_primary_module("fa2", bf16, bf16, bf16, torch.int32, d, d, 0, False,
                                                 False, False) for d in HEAD_DIMS]
    return prefill + [gen_page_module(), gen_cascade_module(), gen_quantization_module()]


def build(spec) -> str:
    start = time.perf_counter()
    spec.build_and_load()
    return f"{spec.name}: {time.perf_counter() - start:.0f} s"


def main() -> None:
    modules = specs()
    missing = [str(s) for m in modules for s in m.sources if not Path(s).exists()]
    if missing:
        sys.exit(f"FlashInfer sources missing (is the package trimmed too far?): {missing[:5]}")
    print(f"{len(modules)} modules, {sum(len(m.sources) for m in modules)} sources present")
    if sys.argv[1:] == ["--sources-only"]:
        return
    with ThreadPoolExecutor(max_workers=2) as pool:
        for line in pool.map(build, modules):
            print(line, flush=True)


if __name__ == "__main__":
    main()
