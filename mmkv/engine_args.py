"""Engine options as command-line flags: one definition for ``mmkv serve`` and its Ray replicas."""

from __future__ import annotations

import argparse
from pathlib import Path

from mmkv.bundled import BUNDLED_MODEL, BUNDLED_SPECULATION
from mmkv.engine import Engine
from mmkv.preemption import POLICIES
from speculative.config import SpeculativeConfig


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The model directory (positional, default: the bundled model) and the engine's flags."""
    p.add_argument("model", nargs="?", type=Path, default=BUNDLED_MODEL,
                   help="model directory (Hugging Face layout); default: the bundled tiny VLM")
    engine = p.add_argument_group("engine")
    engine.add_argument("--kv-cache-memory", default="1GiB")
    engine.add_argument("--host-kv-memory", default="1GiB")
    engine.add_argument("--block-size", type=int, default=16)
    engine.add_argument("--max-num-seqs", type=int, default=256)
    engine.add_argument("--max-num-batched-tokens", type=int, default=2048)
    engine.add_argument("--max-model-len", type=int)
    engine.add_argument("--device", default="auto")
    engine.add_argument("--dtype", default="auto")
    engine.add_argument("--no-prefix-caching", action="store_true")
    engine.add_argument("--eviction-policy", default="lru", choices=("lru", "fifo", "cost"))
    engine.add_argument("--preemption", default="auto", choices=("auto", "swap", "recompute"))
    engine.add_argument("--preemption-policy", default="cost", choices=POLICIES)
    engine.add_argument("--speculative", choices=("early_exit", "draft_model"))
    engine.add_argument("--draft-model", type=Path)
    engine.add_argument("--num-speculative-tokens", type=int)


def engine_from_args(args: argparse.Namespace) -> Engine:
    """The ``Engine`` the flags describe (on the bundled model, speculation takes the settings
    measured fastest on it)."""
    speculative = None
    if args.speculative is not None:
        options = dict(BUNDLED_SPECULATION) if args.model == BUNDLED_MODEL else {}
        if args.num_speculative_tokens is not None:
            options["num_tokens"] = args.num_speculative_tokens
        speculative = SpeculativeConfig(method=args.speculative, draft_model=args.draft_model, **options)
    return Engine(args.model, kv_cache_memory=args.kv_cache_memory, block_size=args.block_size,
                  device=args.device, dtype=args.dtype, host_kv_memory=args.host_kv_memory,
                  max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
                  max_num_seqs=args.max_num_seqs, enable_prefix_caching=not args.no_prefix_caching,
                  eviction_policy=args.eviction_policy, preemption=args.preemption,
                  preemption_policy=args.preemption_policy, speculative=speculative)
