"""Verification rules: greedy equality, and rejection sampling that preserves the target
distribution (checked statistically on a small vocabulary)."""

import torch

from speculative import verify_greedy, verify_sampling


def test_greedy_accepts_the_agreeing_prefix_then_corrects():
    logits = torch.full((4, 5), -1.0)
    for row, best in enumerate([2, 4, 1, 3]):
        logits[row, best] = 1.0
    assert verify_greedy([2, 4, 0], logits) == ([2, 4, 1], 2)
    assert verify_greedy([2, 4, 1], logits) == ([2, 4, 1, 3], 3)  # bonus token
    assert verify_greedy([0, 4, 1], logits) == ([2], 0)
    assert verify_greedy([], logits[:1]) == ([2], 0)


def test_rejection_sampling_preserves_the_target_distribution():
    """Two-token speculation over a 4-token vocabulary. The first output token must follow p0 and
    the second, given the first, p1. With 40,000 trials the total-variation distance of each
    empirical distribution from the exact one has standard deviation below 0.005 (multinomial
    counts, at most sqrt(V/4N) per cell summed), so a bound of 0.02 fails only for a real bias."""
    g = torch.Generator().manual_seed(0)
    q = torch.tensor([[0.7, 0.1, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]])  # draft: far from p
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]])
    first = torch.zeros(4)
    second = torch.zeros(4)
    n_second = 0
    trials = 40_000
    for _ in range(trials):
        drafts = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(2)]
        tokens, accepted = verify_sampling(drafts, q, p, g)
        first[tokens[0]] += 1
        if len(tokens) > 1:
            second[tokens[1]] += 1
            n_second += 1
    tv_first = 0.5 * (first / trials - p[0]).abs().sum()
    tv_second = 0.5 * (second / n_second - p[1]).abs().sum()
    assert tv_first < 0.02 and tv_second < 0.02, (tv_first, tv_second)
    # Without the correction (always accepting drafts) the first token would follow q: TV 0.6.
    assert 0.5 * (q[0] - p[0]).abs().sum() > 0.5
