"""The decoding steps' thread count on the CPU: chosen from measured step times, exact output."""

import math

import pytest
import torch

from mmkv import Engine, SamplingParams
from mmkv.cpu_threads import DecodeThreads
from mmkv.runner import ModelRunner
from speculative import SpeculativeConfig
from conftest import CORES
from test_engine_oracle import BLOCK_BYTES, prompts
from test_speculative_engine import draft_engine


def drive(chooser: DecodeThreads, seconds_on: dict[int, float], steps: int, batch: int = 8) -> list[int]:
    """Decoding steps whose time depends only on the thread count; the counts used, in order."""
    used = []
    for _ in range(steps):
        threads = chooser._pick(True, batch)
        chooser.observe(threads, batch, seconds_on[threads])
        used.append(threads)
    return used


def test_switches_to_fewer_threads_when_they_measure_faster():
    chooser = DecodeThreads(4, explore_every=4, settle_every=16)
    used = drive(chooser, {4: 0.020, 3: 0.012}, 24)
    assert used[:8] == [4, 4, 4, 3, 4, 4, 4, 3]  # the 4th and 8th decoding steps explore
    assert chooser.chosen == 3 and chooser.switches == 1  # two samples, both faster: it switched
    assert used[8:] == [3] * 15 + [4] and chooser.chosen == 3  # settled; exploring back: 4 is slower
    assert chooser.summary()["decode_threads"] == 3


def test_keeps_every_core_when_that_is_faster_and_explores_rarely_once_settled():
    chooser = DecodeThreads(2, explore_every=4, settle_every=16, settle_after=2)
    used = drive(chooser, {2: 0.010, 1: 0.015}, 72)
    assert chooser.chosen == 2 and chooser.switches == 0
    assert [i for i, t in enumerate(used) if t == 1] == [3, 7, 23, 39, 55, 71]
    assert chooser.log_ratio == pytest.approx(0.405, abs=0.01)  # log(15 / 10)


def test_prompt_steps_use_every_core_and_break_the_comparison():
    chooser = DecodeThreads(2, explore_every=2)
    assert chooser._pick(True, 8) == 2
    chooser.observe(2, 8, 0.01)
    assert chooser._pick(False, 9) == 2  # a prompt step: every core, no previous decoding step
    assert chooser._pick(True, 8) == 2  # due to explore, but nothing fair to compare with
    chooser.observe(2, 8, 0.01)
    assert chooser._pick(True, 9) == 2  # the batch changed: still no fair comparison
    chooser.observe(2, 9, 0.01)
    assert chooser._pick(True, 9) == 1


def test_a_switch_rests_on_more_than_one_sample():
    """One step that happened to run faster on fewer threads switches nothing; the estimate is
    the samples' mean until smoothing takes over, so a next sample that says otherwise keeps
    every core, and samples that agree switch."""
    chooser = DecodeThreads(2, explore_every=1, settle_every=1)  # smoothing 0.3
    drive(chooser, {2: 0.010, 1: 0.008}, 2)  # one sample says 1 thread is faster
    assert chooser.chosen == 2 and chooser.samples == 1
    drive(chooser, {2: 0.010, 1: 0.015}, 2)  # the next says it is slower: the mean is above 0
    assert chooser.chosen == 2 and chooser.switches == 0
    assert chooser.log_ratio == pytest.approx((math.log(0.8) + math.log(1.5)) / 2)
    drive(chooser, {2: 0.010, 1: 0.005}, 6)  # a sample far faster moves the estimate below 0
    assert chooser.chosen == 1 and chooser.switches == 1


@pytest.mark.skipif(CORES < 2, reason="one core: nothing to choose")
def test_engine_decodes_on_the_faster_count_with_exact_output(model_dirs, hf_oracle, monkeypatch, every_core):
    """A clock under which steps on fewer threads take half the time: the engine moves its
    decoding steps there, the greedy output stays transformers', and torch has every core back
    once the engine is idle."""
    cores = every_core
    now = [0.0]

    def clock() -> float:
        now[0] += 1.0 if torch.get_num_threads() == cores else 0.5
        return now[0]

    seen = []  # (whether the step only decodes, torch's thread count while it runs)
    original = ModelRunner._timed_plain

    def timed_plain(self, seqs, q_lens, *rest):
        seen.append((all(q == 1 for q in q_lens), torch.get_num_threads()))
        return original(self, seqs, q_lens, *rest)

    monkeypatch.setattr(ModelRunner, "_timed_plain", timed_plain)
    eng = Engine(model_dirs["llama"], kv_cache_memory=512 * BLOCK_BYTES, block_size=4, device="cpu",
                 dtype="float32")
    eng.runner.decode_threads.clock = clock
    eng.runner.decode_threads.explore_every = 2
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for batch in (prompts(3, [5, 9, 14]), prompts(4, [7, 11])):  # the second's prompts after the switch
        for prompt, out in zip(batch, eng.generate(batch, params)):
            hf_oracle.check("llama", prompt, out.outputs[0].token_ids)
        assert eng.stats()["decode_threads"] == cores - 1
    assert (False, cores) in seen and (True, cores - 1) in seen
    assert all(t == cores for decoding, t in seen if not decoding)
    assert torch.get_num_threads() == cores


@pytest.mark.skipif(CORES < 2, reason="one core: nothing to choose")
def test_speculative_rounds_move_to_the_faster_count_and_the_pass_costs_are_learned_afresh(
        model_dirs, hf_oracle, every_core):
    """Rounds with fixed draft lengths under a clock where fewer threads take half the time:
    rounds are decoding steps too, so they move to fewer threads, the greedy output stays
    transformers', and the controller forgets the pass costs it timed on every core (its fits
    restart from the switch on)."""
    cores = every_core
    now = [0.0]

    def clock() -> float:
        now[0] += 1.0 if torch.get_num_threads() == cores else 0.5
        return now[0]

    eng = Engine(model_dirs["llama"], kv_cache_memory=512 * BLOCK_BYTES, block_size=4, device="cpu",
                 dtype="float32", speculative=SpeculativeConfig(num_tokens=2, early_exit_layer=1,
                                                                draft_length="fixed"))
    threads_in_rounds = []
    original = eng.speculator.round

    def counted_round(*args, **kwargs):
        threads_in_rounds.append(torch.get_num_threads())
        return original(*args, **kwargs)

    eng.speculator.round = counted_round
    eng.runner.decode_threads.clock = clock
    eng.runner.decode_threads.explore_every = 2
    batch = prompts(5, [6, 10, 13])
    for prompt, out in zip(batch, eng.generate(batch, SamplingParams(max_tokens=30, ignore_eos=True))):
        hf_oracle.check("llama", prompt, out.outputs[0].token_ids)
    stats = eng.stats()
    assert stats["decode_threads"] == cores - 1
    assert threads_in_rounds[0] == cores and threads_in_rounds[-1] == cores - 1
    assert eng.speculator.controller.costs.counts["verify"] < threads_in_rounds.count(cores - 1)


@pytest.mark.skipif(CORES < 2, reason="one core: nothing to choose")
def test_a_round_that_catches_up_prompts_runs_on_every_core(model_dirs, hf_oracle, every_core):
    """A draft model that skipped the prompts at prefill catches them up in its first round: a
    prompt's work, so that round runs on every core (and is no sample), though the plain steps
    before it moved decoding to fewer threads; the rounds after it, which only decode, run there.
    The target is its own draft, so every draft is accepted and the output is transformers'."""
    cores = every_core
    now = [0.0]

    def clock() -> float:
        now[0] += 1.0 if torch.get_num_threads() == cores else 0.5
        return now[0]

    eng = draft_engine(model_dirs["llama"], model_dirs["llama"], gamma=2)
    eng.runner.decode_threads.clock = clock
    eng.runner.decode_threads.explore_every = 2
    eng.speculator.controller.follow_script([0] * 8 + [2] * 8)  # plain steps, then rounds
    rounds = []  # (whether the round catches up a prompt, torch's thread count while it runs)
    original = eng.speculator.round

    def round_(seqs, gammas, *rest):
        rounds.append((eng.speculator.catches_up_prompts(seqs, gammas), torch.get_num_threads()))
        return original(seqs, gammas, *rest)

    eng.speculator.round = round_
    batch = prompts(5, [6, 10, 13])
    for prompt, out in zip(batch, eng.generate(batch, SamplingParams(max_tokens=24, ignore_eos=True))):
        hf_oracle.check("llama", prompt, out.outputs[0].token_ids)
    assert rounds[0] == (True, cores)
    assert rounds[1:] and all(r == (False, cores - 1) for r in rounds[1:])
    assert eng.stats()["spec_acceptance_rate"] == 1.0
