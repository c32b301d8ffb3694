"""Compressed KV (``kv_cache_dtype`` int8 and fp8_e4m3): the formats against a float64 reference,
the pool's capacity, the engine's paths over compressed blocks, and next-token distributions after
a long context against the uncompressed cache's."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from cache import kv_format
from mmkv import Engine, SamplingParams
from speculative import SpeculativeConfig
from tiny_models import LEARNING, build_model, captured_logits
from tiny_vlms import IMAGE_TOKEN, build_mllama, picture

FORMATS = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)

rows_of_floats = arrays("float32", st.tuples(st.integers(1, 4), st.sampled_from([2, 8, 24])),
                        elements=st.one_of(st.floats(-1e4, 1e4, width=32),
                                           st.floats(-2.0 ** -10, 2.0 ** -10, width=32), st.just(0.0)))


def _bfloat16_below(value: torch.Tensor) -> torch.Tensor:
    """The bfloat16 just below each (positive) bfloat16 ``value``, as float64."""
    bits = value.to(torch.bfloat16).view(torch.int16)
    return (bits - 1).view(torch.bfloat16).double()


@settings(max_examples=200, deadline=None)
@given(rows_of_floats)
def test_int8_rows_decode_within_half_a_step_of_the_tightest_scale(values):
    """Each row's scale is the least bfloat16 at or above its own largest magnitude over 127 (not
    another row's, not one step off), and every decoded value lies within half a scale step of
    the original, computed in float64."""
    x = torch.from_numpy(values)
    rows = kv_format.encode(x, torch.int8)
    scale = kv_format.scales(rows).double()
    need = x.double().abs().amax(-1) / 127.0
    assert (scale >= need).all()
    positive = scale > 0
    assert (_bfloat16_below(scale[positive]) < need[positive]).all(), "the scale is not the tightest"
    assert (scale[need == 0] == 0).all()
    error = (kv_format.decode(rows, torch.float64) - x.double()).abs()
    assert (error <= scale[:, None] / 2 * (1 + 1e-6)).all()


E4M3_VALUES = kv_format.decode(torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn),
                               torch.float64)


@settings(max_examples=200, deadline=None)
@given(rows_of_floats)
def test_fp8_rows_decode_to_the_nearest_e4m3_value(values):
    """fp8 stores each value as the nearest e4m3 value (saturating at +-448), the format FlashInfer
    reads with a scale of 1: checked against every one of the 254 finite values in float64."""
    x = torch.from_numpy(values).double()
    finite = E4M3_VALUES[E4M3_VALUES.isfinite()]
    decoded = kv_format.decode(kv_format.encode(x.float(), torch.float8_e4m3fn), torch.float64)
    nearest = (finite[None, :] - x.clamp(-448, 448).reshape(-1, 1)).abs().min(-1).values
    assert torch.equal((decoded.reshape(-1) - x.clamp(-448, 448).reshape(-1)).abs(), nearest)


def test_the_pool_holds_what_its_format_takes(tmp_path):
    """The same ``kv_cache_memory`` holds 3.76x the tokens in int8 and 4x in fp8 (head size 32:
    32 codes and a 2-byte scale against 128 bytes of float32), the scales counted; a layer kept
    in the model's dtype costs its full width."""
    model = build_model("llama", tmp_path / "m", hidden_size=128, head_dim=32)
    per_token = {}
    for dtype, layers in (("auto", None), ("int8", None), ("fp8_e4m3", None), ("int8", [0])):
        stats = Engine(model, kv_cache_memory="1MiB", device="cpu", kv_cache_dtype=dtype,
                       kv_cache_dtype_layers=layers).stats()
        per_token[dtype, bool(layers)] = stats["kv_bytes_per_token"]
        assert stats["kv_pool_tokens"] == stats["blocks_total"] * stats["block_size"]
        assert stats["kv_pool_bytes"] <= 1 << 20
    heads = 2 * 2  # K and V of two KV heads
    assert per_token["auto", False] == 2 * heads * 32 * 4
    assert per_token["int8", False] == 2 * heads * (32 + 2)
    assert per_token["fp8_e4m3", False] == 2 * heads * 32
    assert per_token["int8", True] == heads * 32 * 4 + heads * (32 + 2)


def test_bad_compression_options_are_refused_naming_them(tmp_path):
    model = build_model("llama", tmp_path / "m")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of 'auto', 'int8', 'fp8_e4m3'"):
        Engine(model, device="cpu", kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype_layers names layer 5; the model has layers 0 to 1"):
        Engine(model, device="cpu", kv_cache_dtype="int8", kv_cache_dtype_layers=[0, 5])
    with pytest.raises(ValueError, match="reads fp8 KV but not int8"):
        Engine(model, device="cpu", kv_cache_dtype="int8", attention_backend="flashinfer")


def _prompts(seed: int, lengths: list[int], vocab: int = 256) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("kv_cache_dtype", sorted(FORMATS))
def test_swapped_compressed_blocks_come_back_as_they_were(model_dirs, kv_cache_dtype):
    """A pool too small for the batch swaps sequences out and back: the output equals the same
    compressed engine's with room for everyone, token for token (the bytes, scales included,
    came back), and no block is left behind."""
    batch = _prompts(5, [30, 41, 37, 25])
    roomy = Engine(model_dirs["llama"], device="cpu", block_size=4, kv_cache_dtype=kv_cache_dtype,
                   kv_cache_memory="8MiB")
    want = [o.token_ids for o in roomy.generate(batch, SamplingParams(max_tokens=24, ignore_eos=True))]
    tight = Engine(model_dirs["llama"], device="cpu", block_size=4, kv_cache_dtype=kv_cache_dtype,
                   kv_cache_memory=34 * roomy.kv.bytes_per_block, host_kv_memory=64 * roomy.kv.bytes_per_block,
                   preemption="swap", debug=True)
    got = [o.token_ids for o in tight.generate(batch, SamplingParams(max_tokens=24, ignore_eos=True))]
    assert tight.stats()["preemptions_swap"] > 0
    assert got == want
    assert tight.stats()["blocks_in_use"] == 0


@pytest.mark.parametrize("kv_cache_dtype", sorted(FORMATS))
def test_shared_prefixes_and_forks_read_the_same_compressed_blocks(model_dirs, kv_cache_dtype):
    """A cached prefix, n > 1 (forks, copy-on-write of the partial block) and a batch agree with
    one request at a time on the same compressed engine, and reuse happened."""
    eng = Engine(model_dirs["llama"], device="cpu", block_size=4, kv_cache_dtype=kv_cache_dtype,
                 kv_cache_memory="4MiB", host_kv_memory="1MiB", debug=True)
    [doc] = _prompts(6, [42])
    batch = [doc + tail for tail in _prompts(7, [3, 5, 6])]
    alone = [eng.generate([p], GREEDY)[0].token_ids for p in batch]
    together = eng.generate(batch, SamplingParams(max_tokens=12, ignore_eos=True, n=2))
    assert [[o.token_ids for o in out.outputs] for out in together] == [[a, a] for a in alone]
    stats = eng.stats()
    assert stats["cache_hits"] > 0 and stats["cow_copies"] > 0 and stats["blocks_in_use"] == 0


@pytest.mark.parametrize("method", ["early_exit", "draft_model"])
def test_speculation_over_compressed_blocks_gives_the_plain_output(model_dirs, tmp_path, method):
    """Early exit reads the target's compressed layers; a draft model keeps its own compressed
    store in the same blocks. Greedy output equals plain decoding over the same compressed cache."""
    target = model_dirs["llama"]
    draft = build_model("llama", tmp_path / "draft", seed=3, num_hidden_layers=1) if method == "draft_model" else None
    batch = _prompts(8, [9, 23, 17])
    plain = Engine(target, device="cpu", block_size=4, kv_cache_dtype="int8")
    want = [o.token_ids for o in plain.generate(batch, GREEDY)]
    spec = Engine(target, device="cpu", block_size=4, kv_cache_dtype="int8", debug=True, kv_cache_memory="8MiB", host_kv_memory="1MiB",
                  speculative=SpeculativeConfig(method=method, num_tokens=3, early_exit_layer=1,
                                                draft_model=draft, settings=LEARNING))
    got = [o.token_ids for o in spec.generate(batch, GREEDY)]
    assert spec.stats()["spec_rounds"] > 0
    assert got == want


def _next_token_logits(engine: Engine, prompts: list) -> torch.Tensor:
    """The logits of each prompt's next token, as the engine's model computed them."""
    return torch.cat(captured_logits(engine, prompts, SamplingParams(max_tokens=1, ignore_eos=True))).double()


def _kl(exact: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """KL(exact || other) of each row's next-token distribution, in nats."""
    p = exact.log_softmax(-1)
    return (p.exp() * (p - other.log_softmax(-1))).sum(-1)


# KL(uncompressed || compressed) of the next token after a 2,000-token context, mean and max over
# its prompts, in nats; measured on these seeds (2026-12-03): int8 mean 3.0e-5 to 4.3e-5, max
# 6.5e-5 to 1.0e-4; fp8 mean 1.2e-3 to 2.3e-3, max 2.5e-3 to 7.1e-3 (docs/memory.md).
KL_BOUNDS = {"int8": (1e-4, 3e-4), "fp8_e4m3": (5e-3, 1.5e-2)}


@pytest.mark.parametrize("family", ["llama", "qwen2", "mllama"])
@pytest.mark.parametrize("kv_cache_dtype", sorted(FORMATS))
def test_next_token_distribution_after_a_long_context_stays_close(tmp_path, family, kv_cache_dtype):
    """Eight questions after a shared 2,000-token document (cached once, then read compressed by
    each): the next token's distribution against the uncompressed cache's, by KL divergence."""
    if family == "mllama":
        model = build_mllama(tmp_path / family, max_position_embeddings=2100)
        head = {"prompt": [IMAGE_TOKEN], "images": [picture(2)]}
    else:
        model = build_model(family, tmp_path / family, max_position_embeddings=2100)
        head = None
    [doc] = _prompts(9, [2000])
    questions = _prompts(10, [4] * 8)
    if head is None:
        batch = [doc + q for q in questions]
    else:
        batch = [{"prompt": head["prompt"] + doc + q, "images": head["images"]} for q in questions]
    logits = {}
    for dtype in ("auto", kv_cache_dtype):
        eng = Engine(model, device="cpu", kv_cache_dtype=dtype, max_model_len=2100)
        logits[dtype] = _next_token_logits(eng, batch)
    kl = _kl(logits["auto"], logits[kv_cache_dtype])
    mean_bound, max_bound = KL_BOUNDS[kv_cache_dtype]
    assert kl.mean() <= mean_bound and kl.max() <= max_bound, (kl.mean().item(), kl.max().item())


def test_the_serve_flags_build_a_compressed_engine(capsys):
    """``--kv-cache-dtype int8 --kv-cache-dtype-layers 0,7`` (``mmkv serve``, Ray replicas): the
    bundled model's slots compressed but those of layers 0 and 7, the metrics' pool figures the
    engine's; a layer list that is not one is refused by the parser, naming it."""
    import argparse

    from mmkv.engine_args import add_engine_arguments, engine_from_args
    from mmkv.server.metrics import ServerMetrics

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--kv-cache-memory", "8MiB", "--kv-cache-dtype", "int8",
                              "--kv-cache-dtype-layers", "0,7"])
    engine = engine_from_args(args)
    kept = {engine.model.layer_slots[0], engine.model.layer_slots[7]}
    assert [layer.dtype for layer in engine.kv.storage.layers] == [
        engine.model.dtype if slot in kept else torch.int8 for slot in range(engine.model.num_slots)]
    stats = engine.stats()
    text = ServerMetrics().render({"engine": stats}).decode()
    assert f"mmkv_kv_pool_tokens {float(stats['kv_pool_tokens'])}" in text
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype-layers", "first,last"])
    assert "expected layer indices such as 0,7, got 'first,last'" in capsys.readouterr().err


def test_integrity_checks_the_scales_of_held_blocks():
    """``check_integrity`` reads every int8 row's scale of a block in use: codes written over a
    scale (here: a negative one) are caught, naming the layer; a free block is not read."""
    from cache import BlockTable, KVCache, KVLayout

    cache = KVCache(KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, block_size=2,
                             layer_dtypes=(torch.float32, torch.int8)), num_blocks=4)
    table = BlockTable()
    cache.append_slots(table, 3)
    layer = cache.storage.layers[1]
    layer[table.blocks[0], 0, 0] = kv_format.encode(torch.tensor([[1.0, -2.0, 0.5, 3.0]]), torch.int8)
    cache.check_integrity()
    free = next(b for b in range(4) if b not in table.blocks)
    layer[free, ..., -2:] = -1  # garbage in a free block is nobody's
    cache.check_integrity()
    layer[table.blocks[1], 1, 0, 0, -2:] = torch.tensor([-1.0], dtype=torch.bfloat16).view(torch.int8)
    with pytest.raises(AssertionError, match="cache layer 1 holds an int8 row whose scale is negative"):
        cache.check_integrity()
    layer[table.blocks[1], 1, 0, 0, -2:] = 0
    cache.free(table)
