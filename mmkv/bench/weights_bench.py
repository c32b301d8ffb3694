"""Quantized weights: mmkv's bfloat16, int8 and int4 against llama.cpp's F16, Q8_0, Q4_0 and Q4_K_M.

The model is a seeded random Llama in TinyLlama-1.1B's shape (hidden 2048, 22 layers, 32 heads,
4 KV heads, MLP 5632, vocabulary 32000; ``--hidden`` and ``--layers`` shrink it), saved in
bfloat16. mmkv loads it with ``dtype="bfloat16"`` as it is, and with ``quantization="int8"`` /
``"int4"`` (groups of 32; the embeddings and the head stay bfloat16). llama.cpp (``--peers
llama.cpp``, installed by ``make bench-peers``) runs the same weights converted by its own
converter to F16 and quantized by its own quantizer (``llama_cpp_peer.quantize``); mmkv also
loads llama.cpp's Q4_K_M and Q8_0 files themselves (``gguf_q4_k_m``, ``gguf_q8_0``: the same file,
repacked into mmkv's layouts at load, ``mmkv.models.gguf_lm``).

Two greedy workloads, each run by every variant in turn, ``--repeats`` rounds (each round in an
order rotated by one), every run from an empty cache:

- **decode**: ``--prompts`` distinct prompts of ``--prompt-tokens`` random tokens, ``--new-tokens``
  new tokens each, all in one batch: mostly plain decoding, whose speed is bandwidth over the bytes
  of weights read per step.
- **prefix**: ``--prefix-requests`` requests sharing a ``--prefix-tokens``-token prefix, each with
  its own ``--suffix-tokens`` tokens, ``--prefix-new-tokens`` new tokens: mmkv prefills the prefix
  once (its radix tree); llama.cpp decodes it once and copies it to every sequence.

Each variant lives in a process of its own, so its memory is its own: ``rss_<variant>`` is its
resident size after the runs (model, KV pool, runtime; llama.cpp's weights are its memory-mapped
file), ``peak_rss_<variant>`` the largest it ever was (``VmHWM``: for mmkv, while the checkpoint's
file was mapped during loading). ``load_rss_<variant>`` is the most anonymous memory (``RssAnon``:
not the mapped file's pages, which the kernel may drop) that loading added to a process that only
loads the model, against ``weight_bytes_<variant>`` (mmkv's ``engine.stats()``, llama.cpp's file
size). Both sides' KV hold the same tokens (the larger workload's). Reported: seconds per workload and variant (the
fastest round), the ratios the goals name (``decode_int4_vs_llama_cpp_q4_k_m`` is llama.cpp's
seconds over mmkv's: above 1, mmkv is faster), and ``greedy_agreement_<variant>``: the share of
generated tokens equal to mmkv bfloat16's before each sequence's first difference (random weights
make near ties, and every quantization breaks some differently).

``--kernels`` measures layers instead (``mmkv.bench.quantized_kernels``, what
``mmkv.quantization.linear.NATIVE_ROWS`` was chosen from): for the model's four GEMM shapes and
several row counts, the native kernel against the weight dequantized for the float GEMM (each in
bfloat16 and in float32 arithmetic), torch's ``_weight_int8pack_mm`` and the unquantized bfloat16
layer (``kernel_<method>_<path>_<arithmetic>_<out>x<in>_r<rows>`` milliseconds per layer call,
weights streamed from memory).
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import tempfile
import threading
import time
from pathlib import Path

from mmkv.bench import llama_cpp_peer, rotated

MMKV_VARIANTS = {"bf16": None, "int8": "int8", "int4": "int4"}
PEER_VARIANTS = {"llama_cpp_f16": "f16", "llama_cpp_q8_0": "q8_0", "llama_cpp_q4_0": "q4_0",
                 "llama_cpp_q4_k_m": "q4_k_m"}
GGUF_VARIANTS = {"gguf_q4_k_m": "llama_cpp_q4_k_m", "gguf_q8_0": "llama_cpp_q8_0"}  # mmkv on the peer's file
RATIOS = {  # field: (llama.cpp variant, mmkv variant, workload)
    "decode_int4_vs_llama_cpp_q4_k_m": ("llama_cpp_q4_k_m", "int4", "decode"),
    "decode_int4_vs_llama_cpp_q4_0": ("llama_cpp_q4_0", "int4", "decode"),
    "decode_int8_vs_llama_cpp_q8_0": ("llama_cpp_q8_0", "int8", "decode"),
    "decode_bf16_vs_llama_cpp_f16": ("llama_cpp_f16", "bf16", "decode"),
    "prefix_int4_vs_llama_cpp_q4_k_m": ("llama_cpp_q4_k_m", "int4", "prefix"),
    "prefix_int8_vs_llama_cpp_q8_0": ("llama_cpp_q8_0", "int8", "prefix"),
    "decode_int4_vs_mmkv_bf16": ("bf16", "int4", "decode"),
    "decode_int8_vs_mmkv_bf16": ("bf16", "int8", "decode"),
    "decode_gguf_q4_k_m_vs_llama_cpp": ("llama_cpp_q4_k_m", "gguf_q4_k_m", "decode"),
    "prefix_gguf_q4_k_m_vs_llama_cpp": ("llama_cpp_q4_k_m", "gguf_q4_k_m", "prefix"),
    "decode_gguf_q8_0_vs_llama_cpp": ("llama_cpp_q8_0", "gguf_q8_0", "decode"),
    "prefix_gguf_q8_0_vs_llama_cpp": ("llama_cpp_q8_0", "gguf_q8_0", "prefix"),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=100)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--prefix-requests", type=int, default=16)
    p.add_argument("--prefix-tokens", type=int, default=600)
    p.add_argument("--suffix-tokens", type=int, default=20)
    p.add_argument("--prefix-new-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variants", default="bf16,int8,int4", help="mmkv's variants to run")
    p.add_argument("--peers", default="", help="llama.cpp: also its F16, Q8_0, Q4_0 and Q4_K_M")
    p.add_argument("--kernels", action="store_true", help="time the layer kernels instead")
    p.add_argument("--seed", type=int, default=0)


def model_config(hidden: int, layers: int) -> dict:
    """TinyLlama-1.1B's shape at full size; narrower and shallower with ``--hidden``/``--layers``
    (heads of 64, MLP 2.75x as TinyLlama's)."""
    return dict(hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
                num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 512),
                vocab_size=32000, max_position_embeddings=2048, initializer_range=0.02,
                rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=None,
                tie_word_embeddings=False)


def save_model(directory: Path, args: argparse.Namespace) -> Path:
    """The random Llama, saved in bfloat16."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(args.seed)
    config = LlamaConfig(**model_config(args.hidden, args.layers))
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    del model
    return directory


def workload(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    token = lambda: rng.randrange(3, 32000)  # noqa: E731
    decode = [[token() for _ in range(args.prompt_tokens)] for _ in range(args.prompts)]
    prefix = [token() for _ in range(args.prefix_tokens)]
    suffixes = [[token() for _ in range(args.suffix_tokens)] for _ in range(args.prefix_requests)]
    return {"decode": (decode, args.new_tokens), "prefix": (prefix, suffixes, args.prefix_new_tokens)}


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


class PeakSampler:
    """The largest anonymous resident size (bytes, ``RssAnon``) seen every 5 ms while it runs."""

    def __init__(self) -> None:
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, status_kib("RssAnon"))
            time.sleep(0.005)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, status_kib("RssAnon"))


def context_tokens(work: dict) -> tuple[int, int]:
    """Sequences and tokens per sequence each side's KV holds: the larger workload's."""
    prefix, suffixes, new = work["prefix"]
    prompts, decode_new = work["decode"]
    return (max(len(suffixes), len(prompts)),
            max(len(prefix) + len(suffixes[0]) + new, len(prompts[0]) + decode_new) + 16)


def open_mmkv(model_dir: Path, quantization: str | None, work: dict):
    """An engine whose KV pool holds what llama.cpp's context does (``context_tokens``)."""
    from mmkv import Engine, SamplingParams
    from mmkv.models.gguf_lm import gguf_file
    from transformers import AutoConfig

    file = gguf_file(model_dir)
    c = (AutoConfig.from_pretrained(model_dir) if file is None
         else AutoConfig.from_pretrained(file.parent, gguf_file=file.name))
    per_token = c.num_hidden_layers * 2 * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 2
    sequences, length = context_tokens(work)
    engine = Engine(model_dir, dtype="bfloat16", quantization=quantization,
                    kv_cache_memory=sequences * length * per_token, host_kv_memory="16MiB")

    def run(name: str) -> list[list[int]]:
        engine.reset_prefix_cache()
        if name == "decode":
            prompts, new = work["decode"]
        else:
            prefix, suffixes, new = work["prefix"]
            prompts = [prefix + s for s in suffixes]
        params = SamplingParams(max_tokens=new, ignore_eos=True)
        return [o.token_ids for o in engine.generate(prompts, params)]

    run("decode")  # warm: first calls build kernels and tables
    return run, engine.stats()["weight_bytes"]


def open_llama_cpp(gguf: Path, work: dict):
    sequences, length = context_tokens(work)
    model = llama_cpp_peer.LlamaCpp(gguf, num_seqs=sequences, max_len=length)

    def run(name: str) -> list[list[int]]:
        if name == "decode":
            prompts, new = work["decode"]
            return model.generate(prompts, new)
        return model.generate_shared_prefix(*work["prefix"])

    run("decode")
    return run, gguf.stat().st_size


def measure_load(connection, source: str, quantization: str | None) -> None:
    """A process that only loads the model as an engine does: sends the peak resident bytes the
    load added to the process (its imports done before)."""
    import torch

    from mmkv.models import load_model
    from mmkv.quantization import Quantization

    before = status_kib("RssAnon")
    with PeakSampler() as load:
        load_model(source, torch.device("cpu"), "bfloat16",
                   None if quantization is None else Quantization(quantization))
    connection.send(load.peak - before)


def serve_variant(connection, kind: str, source: str, quantization: str | None, work: dict) -> None:
    """A variant's process: load, answer ``(workload name)`` with ``(seconds, outputs)`` until
    ``None``, then send its resident bytes now and at their peak."""
    if kind == "mmkv":
        run, weight_bytes = open_mmkv(Path(source), quantization, work)
    else:
        run, weight_bytes = open_llama_cpp(Path(source), work)
    connection.send(weight_bytes)
    from mmkv.bench import timed

    while (name := connection.recv()) is not None:
        outputs, seconds = timed(lambda: run(name))
        connection.send((seconds, outputs))
    connection.send((status_kib("VmRSS"), status_kib("VmHWM")))


def peer_files(model_dir: Path, work_dir: Path) -> dict[str, Path]:
    f16 = llama_cpp_peer.convert(model_dir, work_dir, ["f16"])["f16"]
    files = {"llama_cpp_f16": f16}
    for variant, kind in PEER_VARIANTS.items():
        if kind != "f16":
            files[variant] = llama_cpp_peer.quantize(f16, work_dir / f"model-{kind}.gguf", kind)
    return files


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> float:
    """The share of generated tokens before each sequence's first difference from ``reference``
    (past it, the two continue different texts)."""
    same = 0
    for out, ref in zip(outputs, reference):
        for a, b in zip(out, ref):
            if a != b:
                break
            same += 1
    return round(same / max(1, sum(len(r) for r in reference)), 4)


def run(args: argparse.Namespace) -> dict:
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in MMKV_VARIANTS]
    if unknown:
        raise SystemExit(f"--variants takes {', '.join(MMKV_VARIANTS)}; got {', '.join(unknown)}")
    if args.peers and args.peers != "llama.cpp":
        raise SystemExit(f"--peers takes llama.cpp, got {args.peers!r}")
    if args.kernels:
        from mmkv.bench.quantized_kernels import kernel_times

        config = model_config(args.hidden, args.layers)
        return {"model": config, **kernel_times(config)}
    work = workload(args)
    result: dict = {"model": model_config(args.hidden, args.layers), "repeats": args.repeats}
    missing = llama_cpp_peer.available() if args.peers else None
    if missing:
        result["llama_cpp"] = missing
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_model(Path(tmp) / "model", args)
        sources = {v: ("mmkv", str(model_dir), MMKV_VARIANTS[v]) for v in variants}
        if args.peers and not missing:
            files = peer_files(model_dir, Path(tmp) / "gguf")
            for variant, path in files.items():
                sources[variant] = ("llama.cpp", str(path), None)
            for variant, peer in GGUF_VARIANTS.items():
                sources[variant] = ("mmkv", str(files[peer]), None)
        result.update(compare(sources, work, args.repeats))
    return result


def process_contexts() -> dict:
    """How each kind of variant's process starts: mmkv's forked from a server that has imported
    torch, transformers and mmkv once (each would otherwise spend seconds importing them), the
    peer's spawned fresh, so none of those libraries counts in llama.cpp's memory."""
    server = multiprocessing.get_context("forkserver")
    server.set_forkserver_preload(["torch", "transformers", "mmkv.engine", "mmkv.models",
                                   "mmkv.bench.weights_bench"])
    return {"mmkv": server, "llama.cpp": multiprocessing.get_context("spawn")}


def start(context, target, *args):
    """``target(connection, *args)`` in a process of its own, and this side's end of the
    connection. This process keeps no copy of the other end, so should that process die, a
    ``receive`` from it ends (rather than waiting for an answer that cannot come)."""
    mine, theirs = context.Pipe()
    process = context.Process(target=target, args=(theirs, *args), daemon=True)
    process.start()
    theirs.close()
    return mine, process


def receive(link: tuple, name: str):
    """The next message from a process ``start`` began, or a ``RuntimeError`` naming ``name``
    and how the process ended where it ended first."""
    connection, process = link
    try:
        return connection.recv()
    except EOFError:
        process.join(timeout=30)
        raise RuntimeError(f"{name}'s process ended without answering (exit code {process.exitcode})") from None


def in_process(context, target, *args):
    """``target(connection, *args)``'s one message, from a process of its own."""
    link = start(context, target, *args)
    try:
        return receive(link, target.__name__)
    finally:
        link[1].join()


def compare(sources: dict[str, tuple], work: dict, repeats: int) -> dict:
    """Every variant in its own process, the workloads run in turns (the module docstring)."""
    contexts = process_contexts()
    names = list(sources)
    links, seconds, outputs, out = {}, {}, {}, {}
    try:
        for name in names:  # loaded one at a time, so a load's peak is its own
            kind, source, quantization = sources[name]
            context = contexts[kind]
            if kind == "mmkv":
                out[f"load_rss_{name}"] = in_process(context, measure_load, source, quantization)
            links[name] = start(context, serve_variant, *sources[name], work)
            out[f"weight_bytes_{name}"] = receive(links[name], name)
        for workload in work:
            for order in rotated(names, repeats):
                for name in order:
                    links[name][0].send(workload)
                    took, outs = receive(links[name], name)
                    seconds.setdefault((name, workload), []).append(took)
                    outputs[name, workload] = outs
        for name in names:
            links[name][0].send(None)
            out[f"rss_{name}"], out[f"peak_rss_{name}"] = receive(links[name], name)
    finally:
        for _, process in links.values():
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    for (name, workload), times in seconds.items():
        out[f"{workload}_seconds_{name}"] = round(min(times), 3)
    for field, (slow, fast, workload) in RATIOS.items():
        if (slow, workload) in seconds and (fast, workload) in seconds:
            out[field] = round(min(seconds[slow, workload]) / min(seconds[fast, workload]), 3)
    for name in names:
        if name != "bf16" and ("bf16", "decode") in outputs:
            reference = outputs["bf16", "decode"] + outputs["bf16", "prefix"]
            out[f"greedy_agreement_{name}"] = agreement(
                outputs[name, "decode"] + outputs[name, "prefix"], reference)
        load = out.get(f"load_rss_{name}")
        if load is not None:
            out[f"load_rss_vs_weights_{name}"] = round(load / out[f"weight_bytes_{name}"], 3)
    for bits, peer in (("int4", "llama_cpp_q4_k_m"), ("int8", "llama_cpp_q8_0"), ("bf16", "llama_cpp_f16")):
        if f"rss_{bits}" in out and f"rss_{peer}" in out:
            out[f"rss_{bits}_vs_{peer}"] = round(out[f"rss_{bits}"] / out[f"rss_{peer}"], 3)
    for name, peer in GGUF_VARIANTS.items():
        if f"rss_{name}" in out and f"rss_{peer}" in out:
            out[f"rss_{name}_vs_llama_cpp"] = round(out[f"rss_{name}"] / out[f"rss_{peer}"], 3)
    return out
