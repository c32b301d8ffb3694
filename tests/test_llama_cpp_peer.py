"""The llama.cpp peer: its build compiles in only what the machine runs, and llama.cpp's own Q8_0
quantizer and loader give a model whose greedy tokens follow its F16 original's."""

from __future__ import annotations

from pathlib import Path

import pytest

from mmkv.bench import llama_cpp_peer
from mmkv.bench.random_models import save_random_llama, text_size

# A Sapphire Rapids' flags: AVX-512, AVX-VNNI and AMX.
SAPPHIRE_RAPIDS = {"sse2", "sse4_2", "avx", "avx2", "bmi2", "fma", "f16c", "avx_vnni", "avx512f", "avx512cd",
                   "avx512vl", "avx512dq", "avx512bw", "avx512vbmi", "avx512_vnni", "avx512_bf16",
                   "amx_tile", "amx_int8", "amx_bf16"}


def options(args: str) -> dict[str, str]:
    return dict(arg.removeprefix("-D").split("=") for arg in args.split())


def test_build_enables_what_the_cpu_lists_but_amx_and_nothing_it_lacks():
    sapphire_rapids = options(llama_cpp_peer.cmake_args(SAPPHIRE_RAPIDS))
    assert [k for k, v in sapphire_rapids.items() if v == "OFF"] == ["GGML_NATIVE", "GGML_AMX_TILE",
                                                                    "GGML_AMX_INT8", "GGML_AMX_BF16"]
    assert len(sapphire_rapids) == len(llama_cpp_peer.X86_OPTIONS) + 1
    avx2_only = options(llama_cpp_peer.cmake_args({"sse2", "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f"}))
    assert [k for k, v in avx2_only.items() if v == "ON"] == ["GGML_SSE42", "GGML_AVX", "GGML_AVX2", "GGML_FMA",
                                                             "GGML_F16C"]  # AVX-512F alone is not ggml's AVX512
    assert llama_cpp_peer.cmake_args(set()) == "-DGGML_NATIVE=ON"  # not x86: the compiler's own detection


def test_quantize_names_the_kinds_it_makes():
    with pytest.raises(ValueError, match="one of q8_0, q4_0, q4_k_m, got 'q3_k'"):
        llama_cpp_peer.quantize(Path("model-f16.gguf"), Path("model-q3_k.gguf"), "q3_k")


PROMPTS, PROMPT_LEN, NEW_TOKENS = 16, 12, 8


@pytest.mark.skipif(llama_cpp_peer.available() is not None, reason=str(llama_cpp_peer.available()))
def test_q8_0_greedy_tokens_follow_f16(tmp_path):
    import llama_cpp as L

    model = save_random_llama(tmp_path / "llama", **text_size(128, 2))
    f16 = llama_cpp_peer.convert(model, tmp_path / "gguf", ["f16"])["f16"]
    q8 = llama_cpp_peer.quantize(f16, tmp_path / "gguf" / "model-q8_0.gguf", "q8_0")
    # Q8_0 keeps 34 bytes for each 32 F16 weights (64 bytes); the norms stay F32
    assert 0.5 < q8.stat().st_size / f16.stat().st_size < 0.56
    prompts = [[(97 * s + 31 * i) % 8000 for i in range(PROMPT_LEN)] for s in range(PROMPTS)]
    outputs = {}
    for name, gguf in (("f16", f16), ("q8_0", q8)):
        peer = llama_cpp_peer.LlamaCpp(gguf, PROMPTS, PROMPT_LEN + NEW_TOKENS)
        try:
            assert L.llama_model_ftype(peer.model) == getattr(L, f"LLAMA_FTYPE_MOSTLY_{name.upper()}")
            assert peer.n_vocab == 8000
            outputs[name] = peer.generate(prompts, NEW_TOKENS)
        finally:
            peer.close()
    for out in outputs.values():
        assert [len(tokens) for tokens in out] == [NEW_TOKENS] * PROMPTS
        assert all(0 <= t < 8000 for tokens in out for t in tokens)
    pairs = [(a, b) for fa, qa in zip(outputs["f16"], outputs["q8_0"]) for a, b in zip(fa, qa)]
    agreement = sum(a == b for a, b in pairs) / len(pairs)
    # A random model's top logits lie close together, so Q8_0's rounding flips some argmaxes and a
    # flipped token changes the rest of its sequence: over seeds 0-3 Q8_0 agreed on 63-77% of the
    # positions, Q4_0 on 4-12%, another seed's weights on none. Half tells a wrong quantization
    # type or a garbled load from Q8_0.
    assert agreement >= 0.5, (agreement, outputs)
