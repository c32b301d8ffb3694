"""Greedy output of the engine against transformers' generate on the same weights (fp32).

With ``MMKV_TEST_DEVICE=cuda`` the engines run on the GPU in bfloat16 and outputs are compared up
to near-ties (``devices.py``)."""

import random

import pytest
import torch

from mmkv import Engine, SamplingParams
from devices import DEVICE, DTYPE, ELEMENT_BYTES, assert_near_greedy
from mmkv.attention.torch_backend import TorchBackend
from tiny_models import FAMILIES, load_hf

GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)
BLOCK_BYTES = 2 * 2 * 4 * 2 * 16 * 4  # layers x (K, V) x block_size x kv heads x head_dim x fp32


def prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(n)] for n in lengths]


def engine(model_dirs, family="llama", blocks=512, **kw) -> Engine:
    kw.setdefault("device", DEVICE)
    kw.setdefault("dtype", DTYPE if kw["device"] == DEVICE else "float32")
    block_bytes = BLOCK_BYTES * (ELEMENT_BYTES if kw["dtype"] == DTYPE else 4) // 4
    kw.setdefault("host_kv_memory", blocks * block_bytes)
    kw.setdefault("debug", True)
    return Engine(model_dirs[family], kv_cache_memory=blocks * block_bytes, block_size=4, **kw)


def assert_matches_oracle(outs, batch, family, hf_oracle, max_tokens=16):
    for prompt, out in zip(batch, outs):
        hf_oracle.check(family, prompt, out.token_ids)
        assert len(out.token_ids) == max_tokens
        assert out.finish_reason == "length"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_single_and_mixed_batch(model_dirs, hf_oracle, family):
    eng = engine(model_dirs, family)
    batch = prompts(1, [1, 7, 19, 33, 48])
    assert_matches_oracle(eng.generate(batch[:1], GREEDY), batch[:1], family, hf_oracle)
    assert_matches_oracle(eng.generate(batch, GREEDY), batch, family, hf_oracle)
    assert eng.stats()["blocks_in_use"] == 0


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_shared_prefix_is_served_from_cache(model_dirs, hf_oracle, family):
    eng = engine(model_dirs, family)
    [doc] = prompts(2, [30])
    questions = prompts(3, [5, 6, 7])
    first = eng.generate([doc + questions[0]], GREEDY)[0]
    assert first.cached_tokens == 0
    later = eng.generate([doc + q for q in questions[1:]], GREEDY)
    assert [o.cached_tokens for o in later] == [30, 30]  # 28 in full blocks + 2 copied slots
    assert eng.stats()["cached_prompt_tokens"] == 60
    assert_matches_oracle([first, *later], [doc + q for q in questions], family, hf_oracle)


def test_a_prompt_served_again_whole_computes_its_last_token(model_dirs, hf_oracle):
    """Every block of a repeated 24-token prompt is cached, but its last token is computed again:
    its logits choose the first generated token."""
    eng = engine(model_dirs)
    [prompt] = prompts(6, [24])
    first = eng.generate([prompt], GREEDY)[0]
    computed = eng.stats()["computed_prefill_tokens"]
    again = eng.generate([prompt], GREEDY)[0]
    assert again.cached_tokens == 23 and eng.stats()["computed_prefill_tokens"] == computed + 1
    assert_matches_oracle([first, again], [prompt, prompt], "llama", hf_oracle)


def test_prompts_submitted_together_compute_their_shared_prefix_once(model_dirs, hf_oracle):
    eng = engine(model_dirs)
    [doc] = prompts(4, [41])
    questions = prompts(5, [6] * 5)
    batch = [doc + q for q in questions]
    outs = eng.generate(batch, GREEDY)
    assert_matches_oracle(outs, batch, "llama", hf_oracle)
    assert eng.stats()["computed_prefill_tokens"] == 41 + 5 * 6


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("budget", [3, 8])
def test_chunked_prefill(model_dirs, hf_oracle, budget, family):
    eng = engine(model_dirs, family, max_num_batched_tokens=budget)
    batch = prompts(6, [29, 13, 2])
    assert_matches_oracle(eng.generate(batch, GREEDY), batch, family, hf_oracle)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("policy", ["cost", "newest"])
def test_preemption_under_a_tiny_pool(model_dirs, hf_oracle, mode, family, policy):
    eng = engine(model_dirs, family, blocks=24, preemption=mode, preemption_policy=policy)
    batch = prompts(7, [20, 18, 22, 16, 19])  # 5 x ~9 blocks needed, 24 available
    outs = eng.generate(batch, GREEDY)
    assert_matches_oracle(outs, batch, family, hf_oracle)
    stats = eng.stats()
    assert stats[f"preemptions_{mode}"] > 0
    other = "recompute" if mode == "swap" else "swap"
    assert stats[f"preemptions_{other}"] == 0
    assert (stats["swapped_bytes"] > 0) == (mode == "swap")
    assert (stats["recomputed_tokens"] > 0) == (mode == "recompute")  # a swapped one keeps its K/V
    assert stats["max_preemptions_per_request"] >= 1
    assert stats["blocks_in_use"] == 0


@pytest.mark.parametrize("policy", ["cost", "newest"])
def test_auto_preemption_and_priorities(model_dirs, hf_oracle, policy):
    eng = engine(model_dirs, "mistral", blocks=24, preemption_policy=policy)
    batch = prompts(8, [20, 18, 22, 16, 19])
    params = [SamplingParams(max_tokens=16, ignore_eos=True, priority=p) for p in (1, 0, 1, 0, 2)]
    outs = eng.generate(batch, params)
    assert_matches_oracle(outs, batch, "mistral", hf_oracle)
    stats = eng.stats()
    assert stats["preemptions_swap"] + stats["preemptions_recompute"] > 0


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_n_samples_share_the_prompt_with_copy_on_write(model_dirs, hf_oracle, family):
    eng = engine(model_dirs, family)
    [prompt] = prompts(9, [10])  # ends inside a block: the partial block is shared, then copied
    out = eng.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True, n=3))[0]
    assert [o.token_ids for o in out.outputs] == [out.outputs[0].token_ids] * 3
    hf_oracle.check(family, prompt, out.outputs[0].token_ids)
    assert eng.stats()["cow_copies"] >= 2 and eng.stats()["blocks_in_use"] == 0


def test_logits_agree_with_transformers_within_1e_4(model_dirs):
    """The engine's logits for every generated position equal transformers' full forward."""
    eng = engine(model_dirs, max_num_batched_tokens=5, device="cpu")  # chunked, through the cache
    [prompt] = prompts(10, [23])
    captured = []
    forward = eng.model.forward

    def spy(input_ids, step, rows):
        logits = forward(input_ids, step, rows)
        if len(rows):
            captured.append(logits[0].clone())
        return logits

    eng.model.forward = spy
    out = eng.generate([prompt], GREEDY)[0]
    model = load_hf(model_dirs["llama"])
    with torch.no_grad():
        full = model(torch.tensor([prompt + out.token_ids])).logits[0]
    want = full[len(prompt) - 1: len(prompt) - 1 + 16]
    torch.testing.assert_close(torch.stack(captured), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_rotary_table_holds_the_modules_own_values(model_dirs, family):
    """The engine's cos/sin lookup returns exactly what the rotary module computes per step, as
    its table grows (by doubling) to the longest position asked for."""
    model = engine(model_dirs, family, device="cpu").model
    model.max_model_len = 5000  # beyond the tiny config's 512, to see the table grow
    hidden = torch.zeros(1, 1, model.text_config.hidden_size)
    for positions, size in (([0], 1024), ([5], 1024), ([17, 18, 19], 1024),
                            (list(range(1000, 1037)), 2048), ([3], 2048), ([4999], 5000)):
        ids = torch.tensor([positions])
        got = model.rotary(hidden, ids, max(positions) + 1)
        want = model.text_model.rotary_emb(hidden, position_ids=ids)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), positions
        assert model._rotary_table[0].shape[0] == size


class _DoubledScale(TorchBackend):
    """Attention with twice the softmax scale: a wrong model the near-tie check must catch."""

    def attention(self, step, query, layer, scale, sliding_window):
        return super().attention(step, query, layer, 2 * scale, sliding_window)


def test_bfloat16_greedy_output_is_checked_up_to_near_ties(model_dirs, hf_oracle):
    """What MMKV_TEST_DEVICE=cuda relies on, here on the CPU: a bfloat16 engine's greedy tokens
    lie within the near-tie bound of transformers' float32 argmax (without all being it), and a
    wrong attention does not."""
    batch = prompts(11, [1, 7, 19, 33, 48])
    eng = engine(model_dirs, "llama_rope_scaled", device="cpu", dtype="bfloat16")
    model = hf_oracle.model("llama_rope_scaled")
    for p, o in zip(batch, eng.generate(batch, GREEDY)):
        assert_near_greedy(model, p, o.token_ids)
    wrong = engine(model_dirs, "llama_rope_scaled", device="cpu", dtype="bfloat16",
                   attention_backend=_DoubledScale())
    with pytest.raises(AssertionError, match="standard deviations below the float32 argmax"):
        for p, o in zip(batch, wrong.generate(batch, GREEDY)):
            assert_near_greedy(model, p, o.token_ids)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bfloat16_logits_stay_within_its_precision_of_float32(model_dirs, family):
    """The fast mode (``dtype="bfloat16"``): next-token logits over prompts of 5 to 48 tokens
    differ from float32's by at most 0.15 logit standard deviations (bfloat16 keeps 8 bits of
    mantissa; measured here 0.05-0.07) and pick the same tokens."""
    batch = prompts(60, [5, 17, 33, 48])
    logits = {}
    for dtype in ("float32", "bfloat16"):
        eng = engine(model_dirs, family, dtype=dtype)
        captured = []
        forward = eng.model.forward

        def spy(input_ids, step, rows, forward=forward, captured=captured):
            out = forward(input_ids, step, rows)
            captured.append(out.clone())
            return out

        eng.model.forward = spy
        eng.generate(batch, SamplingParams(max_tokens=1, ignore_eos=True))
        logits[dtype] = torch.cat(captured)
    exact, fast = logits["float32"], logits["bfloat16"]
    assert eng.model.dtype == torch.bfloat16 and fast.shape == exact.shape == (4, 256)
    assert (fast - exact).abs().max() <= 0.15 * exact.std()
    assert torch.equal(fast.argmax(-1), exact.argmax(-1))


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_weights_decode_as_the_dequantized_model(model_dirs, method):
    """A quantized engine (on the CPU the native kernels and, for the prompt, the dequantized
    weight; on CUDA the dequantized weight each call) continues greedily as transformers does on
    the same model with its linear weights replaced by their dequantized values: token for token
    in float32 on the CPU, up to near-ties in bfloat16 on CUDA."""
    from test_quantization import dequantized
    from tiny_models import hf_greedy

    eng = engine(model_dirs, quantization=method)
    oracle = dequantized(load_hf(model_dirs["llama"]), method)
    batch = prompts(11, [4, 21, 37])
    for prompt, out in zip(batch, eng.generate(batch, GREEDY)):
        if DEVICE == "cpu":
            assert out.token_ids == hf_greedy(oracle, prompt, GREEDY.max_tokens)
        else:
            assert_near_greedy(oracle.to(DEVICE), prompt, out.token_ids)
