"""Sampled tokens follow the model's distribution exactly: plain sampling, speculative rounds
(rejection sampling), and temperature / top-k / top-p.

The oracle is exact: a 16-token vocabulary lets every two-token continuation of a prompt be
enumerated, so the marginal distribution of each of the first three generated tokens comes from
transformers' forward passes, filtered by transformers' own logits warpers (independent of
``mmkv.sampler``). The engine samples thousands of seeded requests; a chi-square test per position
compares the counts with the exact marginals (and any token outside the filtered support fails at
once). Planted bugs these tests catch: resampling from the target instead of the residual after a
rejection, a biased acceptance test, and dropping temperature, top-k or top-p (each moves some
position's distribution by a total variation of 0.1 to 0.3, far beyond the tests' noise).
"""

from __future__ import annotations

import pytest
import torch
from transformers import (AutoModelForCausalLM, LlamaConfig, TemperatureLogitsWarper,
                          TopKLogitsWarper, TopPLogitsWarper)

from mmkv import Engine, SamplingParams
from mmkv.sampler import draw, filtered_probs, row_probs
from speculative import SpeculativeConfig
from test_speculative_engine import freeze_costs
from tiny_models import LEARNING

VOCAB = 16
PROMPT = [1, 2, 3, 4, 5]
POSITIONS = 3
FILTERED = dict(temperature=0.6, top_k=4, top_p=0.9)


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory):
    """A 2-layer Llama over 16 tokens whose next-token distributions are spread out enough that
    temperature, top-k and top-p each change them."""
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, vocab_size=VOCAB,
                         max_position_embeddings=64, initializer_range=0.1,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("small_vocab")
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory, AutoModelForCausalLM.from_pretrained(directory).eval()


def warped_probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0) -> torch.Tensor:
    """The distribution transformers' ``generate(do_sample=True, ...)`` draws from."""
    scores = logits.float()
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores.softmax(-1)


@torch.no_grad()
def exact_marginals(model, **filters) -> list[torch.Tensor]:
    """Marginal distribution of each of the first ``POSITIONS`` generated tokens, by enumerating
    every continuation (one batched forward per depth)."""
    prefixes = torch.tensor([PROMPT])
    weights = torch.ones(1)
    marginals = []
    for _ in range(POSITIONS):
        step = warped_probs(model(prefixes).logits[:, -1], **filters)  # [paths, vocab]
        joint = weights[:, None] * step
        marginals.append(joint.sum(0))
        weights = joint.flatten()
        prefixes = torch.cat([prefixes.repeat_interleave(VOCAB, 0),
                              torch.arange(VOCAB).repeat(prefixes.shape[0])[:, None]], dim=1)
    return marginals


def chi_square_p_value(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Upper-tail p-value of Pearson's chi-square statistic over the tokens with positive
    probability (cells expecting fewer than 5 counts are pooled)."""
    n = observed.sum()
    expected = expected_probs.double() * n
    big = expected >= 5
    obs = torch.cat([observed[big].double(), observed[~big].double().sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = (((obs - exp) ** 2)[keep] / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def assert_samples_follow(outs, exact: list[torch.Tensor]) -> None:
    for position, probs in enumerate(exact):
        seen = torch.bincount(torch.tensor([o.token_ids[position] for o in outs]), minlength=VOCAB)
        outside = [t for t in range(VOCAB) if seen[t] and probs[t] == 0]
        assert not outside, f"position {position}: sampled tokens {outside} the filters exclude"
        p = chi_square_p_value(seen, probs)
        # Three positions per test at 1e-6 each: a false alarm about once in 300k runs.
        assert p > 1e-6, (position, p, (seen / seen.sum()).tolist(), probs.tolist())


def sample_many(directory, n: int, speculative: SpeculativeConfig | None, **filters):
    """``n`` seeded samples. With speculation the draft-length controller is on, its cost model
    frozen where drafting is cheap (on this model plain decoding is faster, so measured costs
    would have it decode plainly): each sequence drafts as far as its measured acceptance
    warrants, up to its room."""
    params = [SamplingParams(max_tokens=POSITIONS, seed=s, ignore_eos=True, **filters)
              for s in range(n)]
    eng = Engine(directory, kv_cache_memory=1 << 22, host_kv_memory=1 << 20, block_size=4,
                 device="cpu", speculative=speculative)
    if speculative is not None:
        freeze_costs(eng, draft=lambda r: 0.01 + 1e-5 * r, verify=lambda r: 1 + 1e-4 * r)
    outs = eng.generate([PROMPT] * n, params)
    return outs, eng.stats()


@pytest.mark.parametrize("num_tokens", [1, 2])
def test_rejection_sampling_keeps_the_target_distribution(small_vocab_model, num_tokens):
    """6000 samples at temperature 1 with early exit after layer 1 drafting, lengths chosen by the
    controller. Every generated token comes from a speculative round: the prompt's last token is
    computed by one when its first block is cached, which it is after the first request, so
    positions 0-2 cover accepted drafts, corrections drawn from the residual and bonus tokens."""
    directory, model = small_vocab_model
    outs, stats = sample_many(directory, 6_000, SpeculativeConfig(num_tokens=num_tokens,
                                                                   early_exit_layer=1, settings=LEARNING),
                              temperature=1.0)
    assert stats["spec_rounds"] >= 6_000 and 0 < stats["spec_acceptance_rate"] < 1
    assert_samples_follow(outs, exact_marginals(model))


@pytest.mark.parametrize("speculative", [None, SpeculativeConfig(num_tokens=2, early_exit_layer=1, settings=LEARNING)],
                         ids=["plain", "speculative"])
def test_temperature_top_k_and_top_p_shape_the_distribution(small_vocab_model, speculative):
    """4000 samples with temperature 0.6, top-k 4 and top-p 0.9 against transformers' warpers."""
    directory, model = small_vocab_model
    exact = exact_marginals(model, **FILTERED)
    loose = [exact_marginals(model, **{**FILTERED, name: off})
             for name, off in (("temperature", 1.0), ("top_k", 0), ("top_p", 1.0))]
    for without in loose:  # each filter matters on this model, so dropping one is detectable
        assert max(0.5 * (a - b).abs().sum() for a, b in zip(exact, without)) > 0.08
    outs, stats = sample_many(directory, 4_000, speculative, **FILTERED)
    if speculative is not None:
        assert stats["spec_rounds"] >= 4_000 and 0 < stats["spec_acceptance_rate"] < 1
    assert_samples_follow(outs, exact)


def test_draw_follows_each_rows_weights_with_its_own_generator():
    """``draw`` takes one token from each row of weights (unnormalised, with zero weights)
    by its own generator: 40,000 draws of each row come within a total variation of 0.02 of the
    row's normalised weights (standard deviation below 0.005), a zero-weight token never comes,
    and a seeded row draws the same tokens whatever rows share its call. A row whose weights do
    not sum to a positive, finite number is named in a ``ValueError``, and no generator has
    advanced."""
    weights = torch.tensor([[0.0, 2.0, 1.0, 0.0, 5.0, 0.5, 0.0, 1.5],
                            [0.3, 0.0, 0.0, 0.1, 0.0, 0.0, 0.2, 0.0]])
    trials = 40_000
    for row in weights:
        generator = torch.Generator().manual_seed(0)
        counts = torch.bincount(torch.tensor(draw(row.expand(trials, -1), [generator] * trials)),
                                minlength=len(row)).float()
        assert (counts[row == 0] == 0).all()
        assert 0.5 * (counts / trials - row / row.sum()).abs().sum() < 0.02
    alone = [draw(weights[1:], [torch.Generator().manual_seed(7)]) for _ in range(5)]
    shared = [draw(weights, [torch.Generator().manual_seed(i), torch.Generator().manual_seed(7)])[1:]
              for i in range(5)]
    assert alone == shared
    generator = torch.Generator().manual_seed(3)
    state = generator.get_state()
    for bad in (torch.zeros(8), torch.full((8,), float("nan"))):
        with pytest.raises(ValueError, match="row 1 has no token of positive, finite probability"):
            draw(torch.stack([weights[0], bad]), [generator, generator])
        assert torch.equal(generator.get_state(), state)


def test_row_probs_filters_each_row_by_its_own_parameters():
    """Rows of mixed sampling parameters, filtered together, equal each row filtered alone."""
    torch.manual_seed(0)
    logits = torch.randn(6, 40) * 3
    params = [SamplingParams(**FILTERED), SamplingParams(temperature=1.2),
              SamplingParams(temperature=0.6, top_p=0.5), SamplingParams(**FILTERED),
              SamplingParams(temperature=0.9, min_p=0.2), SamplingParams(temperature=0.6, top_k=4)]
    got = row_probs(logits, params)
    want = torch.stack([filtered_probs(row, p) for row, p in zip(logits, params)])
    assert torch.allclose(got, want, atol=1e-7) and torch.equal(got > 0, want > 0)
