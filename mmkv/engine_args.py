"""Engine options as command-line flags: one definition for ``mmkv serve`` and its Ray replicas.

Defining the flags imports nothing heavy, so the command parses its arguments (and answers
``--help``) before torch and transformers load; ``engine_from_args`` loads them.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from mmkv.bundled import BUNDLED_MODEL, BUNDLED_SPECULATION
from mmkv.preemption import POLICIES

if TYPE_CHECKING:
    from mmkv.engine import Engine


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The model directory (positional, default: the bundled model) and the engine's flags."""
    p.add_argument("model", nargs="?", type=Path, default=BUNDLED_MODEL,
                   help="model directory in Hugging Face layout (default: the bundled tiny VLM)")
    engine = p.add_argument_group("engine")
    engine.add_argument("--kv-cache-memory", default="1GiB",
                        help="bytes of the device KV pool, e.g. 4GiB")
    engine.add_argument("--host-kv-memory", default="1GiB",
                        help="bytes of the host tier that preempted sequences swap to")
    engine.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    engine.add_argument("--kv-cache-dtype", default="auto",
                        help="how blocks store K/V: auto (the model's dtype), int8 (a scale per "
                             "token and head) or fp8_e4m3: 2-4x the tokens in the same memory")
    engine.add_argument("--kv-cache-dtype-layers", type=layer_list, default=None,
                        help="decoder layers whose K/V stay in the model's dtype, e.g. 0,7")
    engine.add_argument("--quantization", choices=("int8", "int4"),
                        help="quantize the linear layers' weights while loading: int8 (a scale per "
                             "output channel) or int4 (a scale and offset per group of inputs)")
    engine.add_argument("--quantization-group-size", type=int, default=32,
                        help="inputs per int4 group (default 32)")
    engine.add_argument("--quantize-lm-head", action="store_true",
                        help="quantize the LM head too (to int8)")
    engine.add_argument("--draft-quantization", choices=("int8", "int4"),
                        help="quantize the draft model of --speculative draft_model")
    engine.add_argument("--max-num-seqs", type=int, default=256, help="sequences one step runs")
    engine.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="tokens one step computes (long prompts are prefilled in chunks)")
    engine.add_argument("--max-model-len", type=int,
                        help="the most tokens a sequence holds (default: the model's); a prompt of "
                             "more characters than this times its tokenizer's longest token is "
                             "refused before it is tokenized")
    engine.add_argument("--device", default="auto", help="cpu, cuda, or auto (cuda when present)")
    engine.add_argument("--dtype", default="auto",
                        help="float32 or bfloat16; auto: float32 on the CPU, the checkpoint's on a GPU")
    engine.add_argument("--no-prefix-caching", action="store_true",
                        help="share no prefix or image across requests")
    engine.add_argument("--eviction-policy", default="lru", choices=("lru", "fifo", "cost"),
                        help="which cached blocks are evicted first")
    engine.add_argument("--preemption", default="auto", choices=("auto", "swap", "recompute"),
                        help="how a preempted sequence's KV is kept: auto picks the cheaper")
    engine.add_argument("--preemption-policy", default="newest", choices=POLICIES,
                        help="which running sequence gives way when the pool is full")
    engine.add_argument("--speculative", choices=("early_exit", "draft_model"),
                        help="speculative decoding (default: none)")
    engine.add_argument("--draft-model", type=Path, help="the draft model for --speculative draft_model")
    engine.add_argument("--num-speculative-tokens", type=int,
                        help="the most draft tokens a round (default: the method's)")


def engine_from_args(args: argparse.Namespace) -> Engine:
    """The ``Engine`` the flags describe (on the bundled model, speculation takes the settings
    measured fastest on it)."""
    from mmkv.engine import Engine  # torch and transformers load here, when an engine is built

    return Engine(args.model, **engine_options(args))


def engine_options(args: argparse.Namespace) -> dict:
    """``Engine``'s keyword arguments (all but the model) that the flags describe."""
    from speculative.config import SpeculativeConfig

    speculative = None
    if args.speculative is not None:
        options = dict(BUNDLED_SPECULATION) if args.model == BUNDLED_MODEL else {}
        if args.num_speculative_tokens is not None:
            options["num_tokens"] = args.num_speculative_tokens
        speculative = SpeculativeConfig(method=args.speculative, draft_model=args.draft_model,
                                        draft_quantization=args.draft_quantization, **options)
    return dict(kv_cache_memory=args.kv_cache_memory, block_size=args.block_size,
                device=args.device, dtype=args.dtype, host_kv_memory=args.host_kv_memory,
                max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
                max_num_seqs=args.max_num_seqs, enable_prefix_caching=not args.no_prefix_caching,
                eviction_policy=args.eviction_policy, preemption=args.preemption,
                preemption_policy=args.preemption_policy, speculative=speculative,
                kv_cache_dtype=args.kv_cache_dtype, kv_cache_dtype_layers=args.kv_cache_dtype_layers,
                quantization=args.quantization, quantization_group_size=args.quantization_group_size,
                quantize_lm_head=args.quantize_lm_head)


def layer_list(text: str) -> list[int]:
    """``"0,7"`` -> ``[0, 7]``; ``argparse.ArgumentTypeError`` naming what is not a layer index."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layer indices such as 0,7, got {text!r}") from None
