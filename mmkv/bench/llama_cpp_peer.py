"""llama.cpp as a peer: the same checkpoint converted to GGUF by llama.cpp's own converter (and,
for weight benchmarks, quantised by its own quantizer), run through llama-cpp-python's low-level API.

Plain mode (``generate``): every prompt is its own sequence, all decoded together, then every
sequence decodes greedily in one batch per step. Shared-prefix mode (``generate_shared_prefix``),
which suits shared-prefix work best: the prefix is decoded once as sequence 0 and copied to every
other sequence (``llama_memory_seq_cp``), each sequence's own suffix is decoded in one batch, then
decoding goes as in plain mode. ``n_threads`` is the machine's cores. Outputs are argmax token
ids, comparable with mmkv's greedy output.

``make bench-peers`` installs llama-cpp-python (it compiles llama.cpp), gguf and sentencepiece, and
puts llama.cpp's converter (``convert_hf_to_gguf.py`` and its modules, from the llama-cpp-python
source distribution) under ``.peers/llama.cpp``. Without them ``available()`` says what is missing.
It builds llama.cpp with ``cmake_args()``: on x86 Linux, only the instruction sets this CPU lists
(the kernel enabled), and never AMX (``cmake_args`` says why).
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

CONVERTER = Path(__file__).resolve().parents[2] / ".peers" / "llama.cpp" / "convert_hf_to_gguf.py"

# ggml's x86 build options and the /proc/cpuinfo flags each needs (the kernel lists a flag only
# when it enabled the registers the instructions use); GGML_AVX512 is ggml's F+CD+VL+DQ+BW.
X86_OPTIONS = {
    "SSE42": ("sse4_2",), "AVX": ("avx",), "AVX2": ("avx2",), "BMI2": ("bmi2",), "FMA": ("fma",),
    "F16C": ("f16c",), "AVX_VNNI": ("avx_vnni",),
    "AVX512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),
    "AVX512_VBMI": ("avx512vbmi",), "AVX512_VNNI": ("avx512_vnni",), "AVX512_BF16": ("avx512_bf16",),
    "AMX_TILE": ("amx_tile",), "AMX_INT8": ("amx_int8",), "AMX_BF16": ("amx_bf16",),
}


def cpu_flags() -> set[str]:
    """The x86 feature flags /proc/cpuinfo lists for the first CPU; empty elsewhere."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return set()
    return next((set(line.split(":", 1)[1].split()) for line in lines if line.startswith("flags")), set())


def cmake_args(flags: set[str] | None = None) -> str:
    """llama.cpp's CMake options for this machine (``flags``: its cpuinfo flags unless given). On
    x86: ``-DGGML_NATIVE=OFF`` and each ``X86_OPTIONS`` entry ON exactly when the CPU lists all its
    flags, so no instruction the OS has not enabled is compiled in; AMX's always OFF: llama.cpp's
    AMX kernels (this version's) stop on an illegal instruction, a tile load with no tile
    configuration, on an Intel Xeon with AMX (Q8_0 and Q4_K_M files, one thread or two), where
    its AVX-512 VNNI kernels run. Elsewhere: ``-DGGML_NATIVE=ON``."""
    flags = cpu_flags() if flags is None else flags
    if "sse2" not in flags:
        return "-DGGML_NATIVE=ON"
    on = {name for name, needs in X86_OPTIONS.items() if flags.issuperset(needs) and not name.startswith("AMX")}
    return " ".join(["-DGGML_NATIVE=OFF"] + [f"-DGGML_{n}={'ON' if n in on else 'OFF'}" for n in X86_OPTIONS])


def available() -> str | None:
    """None when the peer can run, else why not."""
    try:
        import llama_cpp  # noqa: F401
        import sentencepiece  # noqa: F401
    except ImportError as err:
        return f"llama.cpp peer not installed ({err.name}): run `make bench-peers`"
    if not CONVERTER.is_file():
        return f"llama.cpp's converter is missing ({CONVERTER}): run `make bench-peers`"
    return None


def convert(model_dir: Path, work: Path, outtypes: list[str]) -> dict[str, Path]:
    """GGUF files of the Hugging Face checkpoint ``model_dir``, one per ``outtype`` (``f32``,
    ``f16``), written under ``work``. llama.cpp's converter needs a tokenizer to write the GGUF
    vocabulary, so a small SentencePiece model goes beside links to the checkpoint's files (ids
    past its pieces become placeholders: the benchmark feeds token ids, never text)."""
    import sentencepiece as spm

    source = work / "checkpoint"
    source.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.suffix in (".json", ".safetensors") and not (source / f.name).exists():
            (source / f.name).symlink_to(f.resolve())
    text = (" ".join(str(i * j % 997) for j in range(64)) for i in range(400))
    spm.SentencePieceTrainer.train(sentence_iterator=text, model_prefix=str(source / "tokenizer"),
                                   vocab_size=400, model_type="bpe", minloglevel=2,
                                   byte_fallback=True, hard_vocab_limit=False)
    out = {}
    for outtype in outtypes:
        out[outtype] = work / f"model-{outtype}.gguf"
        subprocess.run([sys.executable, str(CONVERTER), str(source), "--outfile", str(out[outtype]),
                        "--outtype", outtype], check=True, capture_output=True, text=True)
    return out


QUANT_KINDS = ("q8_0", "q4_0", "q4_k_m")


def quantize(f16_gguf: Path, out: Path, kind: str) -> Path:
    """``out``: ``f16_gguf`` quantised by llama.cpp's own quantizer (``llama-quantize``'s
    defaults) to ``kind``, one of ``QUANT_KINDS``, on every core."""
    if kind not in QUANT_KINDS:
        raise ValueError(f"quantization kind must be one of {', '.join(QUANT_KINDS)}, got {kind!r}")
    import llama_cpp as L

    params = L.llama_model_quantize_default_params()
    params.ftype = getattr(L, f"LLAMA_FTYPE_MOSTLY_{kind.upper()}")
    params.nthread = os.cpu_count() or 1
    if L.llama_model_quantize(str(f16_gguf).encode(), str(out).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {f16_gguf} to {kind}")
    return out


class LlamaCpp:
    """One GGUF model in a llama.cpp context sized for ``num_seqs`` sequences of ``max_len``."""

    def __init__(self, gguf: Path, num_seqs: int, max_len: int, threads: int | None = None,
                 kv_type: str = "f16") -> None:
        """``kv_type``: the K and V cache's type, ``f16`` (llama.cpp's default) or ``q8_0``
        (``--cache-type-k/-v q8_0``; a quantised V cache needs flash attention, which it turns on)."""
        import llama_cpp as L

        self.L = L
        L.llama_backend_init()
        params = L.llama_model_default_params()
        self.model = L.llama_model_load_from_file(str(gguf).encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        ctx = L.llama_context_default_params()
        ctx.n_ctx = num_seqs * max_len
        ctx.n_batch = ctx.n_ubatch = max(512, num_seqs * 32)
        ctx.n_seq_max = num_seqs
        ctx.kv_unified = True
        if kv_type != "f16":
            ctx.type_k = ctx.type_v = getattr(L, f"GGML_TYPE_{kv_type.upper()}")
            ctx.flash_attn_type = 1  # LLAMA_FLASH_ATTN_TYPE_ENABLED
        threads = threads or os.cpu_count()
        ctx.n_threads = ctx.n_threads_batch = threads
        self.ctx = L.llama_init_from_model(self.model, ctx)
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.batch = L.llama_batch_init(ctx.n_batch, 0, num_seqs)
        self.n_batch = ctx.n_batch
        self.num_seqs = num_seqs

    def close(self) -> None:
        L = self.L
        L.llama_batch_free(self.batch)
        L.llama_free(self.ctx)
        L.llama_model_free(self.model)

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> list[np.ndarray]:
        """Decode ``(token, position, sequence, wants_logits)`` items in batches of ``n_batch``;
        the logits of the items that want them, in order."""
        L, b = self.L, self.batch
        out = []
        for start in range(0, len(items), self.n_batch):
            chunk = items[start:start + self.n_batch]
            b.n_tokens = len(chunk)
            for i, (token, pos, seq, logits) in enumerate(chunk):
                b.token[i], b.pos[i], b.n_seq_id[i] = token, pos, 1
                b.seq_id[i][0] = seq
                b.logits[i] = logits
            if L.llama_decode(self.ctx, b) != 0:
                raise RuntimeError("llama_decode failed")
            for i, (_, _, _, logits) in enumerate(chunk):
                if logits:
                    row = L.llama_get_logits_ith(self.ctx, i)
                    out.append(np.ctypeslib.as_array(row, shape=(self.n_vocab,)).copy())
        return out

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        """Greedy continuations of every prompt, each its own sequence: all prompts' tokens are
        decoded together (``n_batch`` at a time), then every sequence decodes in one batch per step."""
        if len(prompts) > self.num_seqs:
            raise ValueError(f"at most {self.num_seqs} prompts fit this context, got {len(prompts)}")
        L = self.L
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
        items = [(t, pos, seq, pos == len(prompt) - 1)
                 for seq, prompt in enumerate(prompts) for pos, t in enumerate(prompt)]
        return self._greedy(self._decode(items), [len(p) for p in prompts], list(range(len(prompts))),
                            new_tokens)

    def generate_shared_prefix(self, prefix: list[int], suffixes: list[list[int]],
                               new_tokens: int) -> list[list[int]]:
        """Greedy continuations of ``prefix + suffix`` for every suffix."""
        L = self.L
        memory = L.llama_get_memory(self.ctx)
        L.llama_memory_clear(memory, True)
        self._decode([(t, p, 0, False) for p, t in enumerate(prefix)])
        for s in range(1, len(suffixes)):
            L.llama_memory_seq_cp(memory, 0, s, -1, -1)
        n = len(prefix)
        items = [(t, n + i, s, i == len(suf) - 1) for s, suf in enumerate(suffixes) for i, t in enumerate(suf)]
        return self._greedy(self._decode(items), [n + len(suf) for suf in suffixes],
                            list(range(len(suffixes))), new_tokens)

    def _greedy(self, logits: list[np.ndarray], positions: list[int], seqs: list[int],
                new_tokens: int) -> list[list[int]]:
        """``new_tokens`` greedy tokens for each of ``seqs``, decoded together a step at a time,
        from the logits of their last prompt token; ``positions``: where each one's first new
        token goes."""
        outs: list[list[int]] = [[] for _ in seqs]
        for step in range(new_tokens):
            tokens = [int(row.argmax()) for row in logits]
            for o, t in zip(outs, tokens):
                o.append(t)
            if step == new_tokens - 1:
                break
            logits = self._decode([(t, position + step, seq, True)
                                   for seq, position, t in zip(seqs, positions, tokens)])
        return outs

    def serve_slots(self, batches: list[list[list[int]]], new_tokens: int) -> tuple[list[list[int]], int]:
        """Greedy answers of ``new_tokens`` to every prompt, a batch at a time, as llama-server
        serves parallel slots with its prompt cache: each sequence is a slot that keeps its last
        prompt's K/V, a prompt goes to the free slot whose cached tokens share the longest prefix
        with it (the least recently used on a tie), the slot keeps that prefix and decodes the
        rest. Returns the answers in order and the prompt tokens served from the slots' caches."""
        L = self.L
        memory = L.llama_get_memory(self.ctx)
        slots: list[list[int]] = [[] for _ in range(self.num_seqs)]
        used = [0] * self.num_seqs
        answers: list[list[int]] = []
        reused = clock = 0
        for prompts in batches:
            free, chosen = set(range(self.num_seqs)), []
            for prompt in prompts:
                def shared(s: int) -> int:
                    n = 0
                    for a, b in zip(slots[s], prompt[:-1]):  # the last prompt token is always decoded
                        if a != b:
                            break
                        n += 1
                    return n

                slot = max(free, key=lambda s: (shared(s), -used[s]))
                free.discard(slot)
                keep = shared(slot)
                L.llama_memory_seq_rm(memory, slot, keep, -1)
                chosen.append((slot, keep))
                reused += keep
                clock += 1
                used[slot] = clock
            items = [(t, pos, slot, pos == len(prompt) - 1) for (slot, keep), prompt in zip(chosen, prompts)
                     for pos, t in enumerate(prompt) if pos >= keep]
            outs = self._greedy(self._decode(items), [len(p) for p in prompts],
                                [slot for slot, _ in chosen], new_tokens)
            for (slot, _), prompt, out in zip(chosen, prompts, outs):
                slots[slot] = prompt + out[:-1]  # the last answer token was never decoded
            answers += outs
        return answers, reused
