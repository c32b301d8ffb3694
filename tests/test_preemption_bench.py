"""``python -m mmkv.bench preemption`` at a tiny size: every cell of the pool and mode grid runs
both policies to equal outputs, the workloads are what the options say, and bad options are
refused with what is allowed."""

from __future__ import annotations

import argparse

import pytest

from mmkv.bench import preemption_bench
from test_benchmarks import bench

TINY = ("--hidden-size", "64", "--num-layers", "2", "--repeats", "1", "--every", "1")


def test_every_pool_and_mode_runs_both_policies_to_equal_outputs():
    """Two pools and two modes: four cells in order, preemptions in every one under both
    policies (the pools are far too small), none swapped under ``recompute``."""
    result = bench("preemption", "--long", "2", "--long-prompt", "64", "--long-answer", "4",
                   "--short", "6", "--short-prompt", "8", "--short-answer", "24", "--kv-blocks", "8,10",
                   "--host-blocks", "2", "--preemption", "recompute,auto", *TINY)
    assert result["outputs_equal"] is True and result["requests"] == 8
    cells = result["cells"]
    assert [(c["kv_blocks"], c["preemption"]) for c in cells] == [
        (8, "recompute"), (8, "auto"), (10, "recompute"), (10, "auto")]
    for c in cells:
        for policy in ("cost", "newest"):
            assert c[f"preemptions_swap_{policy}"] + c[f"preemptions_recompute_{policy}"] > 0
            assert c[f"max_preemptions_per_request_{policy}"] >= 1
            if c["preemption"] == "recompute":
                assert c[f"swapped_bytes_{policy}"] == 0 and c[f"preemptions_swap_{policy}"] == 0
        assert c["recomputed_tokens_cost_vs_newest"] >= 0 and c["seconds_cost_vs_newest"] > 0
    ratios = [c["seconds_cost_vs_newest"] for c in cells]
    assert result["seconds_cost_vs_newest_min"] == min(ratios)
    assert result["seconds_cost_vs_newest_max"] == max(ratios)
    assert result["restore_speeds"]["flops"] > 0


def test_the_mixed_lengths_workload_is_drawn_from_its_seed():
    """10 prompts of 270-330 tokens with 4-16-token answers and 10 of 24-36 tokens with
    120-200-token answers, shuffled; another seed draws another workload."""
    def sizes(seed: int) -> list[tuple[int, int]]:
        args = argparse.Namespace(workload="mixed-lengths", seed=seed)
        return [(len(prompt), params.max_tokens) for prompt, params in preemption_bench.workload(args)]

    drawn = sizes(1)
    assert len(drawn) == 20 and drawn == sizes(1) and drawn != sizes(2)
    long = sorted(s for s in drawn if s[0] >= 270)
    short = sorted(s for s in drawn if s[0] < 270)
    assert len(long) == len(short) == 10 and long != drawn[:10]
    assert all(270 <= p <= 330 and 4 <= a <= 16 for p, a in long)
    assert all(24 <= p <= 36 and 120 <= a <= 200 for p, a in short)


@pytest.mark.parametrize("option, value, message", [
    ("--kv-blocks", "8,0", "expected positive integers such as 120,160, got '8,0'"),
    ("--preemption", "auto,later", "preemption modes are auto, swap, recompute; got 'auto,later'"),
    ("--workload", "uniform", "invalid choice: 'uniform'"),
])
def test_bad_options_are_refused_naming_what_is_allowed(option, value, message, capsys):
    with pytest.raises(SystemExit):
        bench("preemption", "--long", "1", "--long-prompt", "8", "--short", "1", *TINY, option, value)
    assert message in capsys.readouterr().err
