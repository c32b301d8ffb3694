"""Every benchmark runs end to end at a small size, its outputs equal its peer's, and its counts
mean what the README says; a benchmark whose outputs differ exits non-zero."""

import argparse
import contextlib
import gc
import io
import json
import multiprocessing
import os
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest

from mmkv.bench import __main__ as bench_main
from mmkv.bench import llama_cpp_peer, rotated, spec_bench, spec_compare
from speculative import SpeculativeConfig
from speculative.controller import DraftLengthController
from test_speculative_engine import freeze_costs

ROOT = Path(__file__).parent.parent


def bench(*argv: str) -> dict:
    """``python -m mmkv.bench <argv> --json``'s JSON line, its ``main`` run in this process: a
    process of its own would first spend ~13 s importing torch and transformers (the cache
    bench's test runs the command itself)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        bench_main.main([*argv, "--json"])
    return json.loads(out.getvalue().splitlines()[-1])


def test_a_benchmark_runs_with_what_existed_before_it_frozen(monkeypatch, capsys):
    """``main`` freezes every object the process holds when the benchmark starts (the collection
    before each timed run then scans only what the runs build) and unfreezes them when it ends."""
    from mmkv.bench import penalties_bench

    frozen = []
    monkeypatch.setattr(penalties_bench, "run", lambda args: frozen.append(gc.get_freeze_count()) or {})
    before, held = gc.get_freeze_count(), len(gc.get_objects())
    bench_main.main(["penalties"])
    assert frozen[0] >= before + 0.9 * held
    assert gc.get_freeze_count() == before


def test_cache_bench_evicts_everything_it_cached():
    """Through the README's command line, in a process of its own."""
    out = subprocess.run([sys.executable, "-m", "mmkv.bench", "cache", "--requests", "60", "--documents", "6",
                          "--doc-tokens", "64", "--question-tokens", "16", "--prompt-tokens", "512",
                          "--repeats", "2", "--json"], check=True, capture_output=True, text=True,
                         timeout=300, cwd=ROOT).stdout
    result = json.loads(out.splitlines()[-1])
    # Six shared documents once (4 blocks each), each request's question block, and the two
    # timed prompts beyond their document: the tree stores each distinct block once.
    assert result["cached_blocks"] == result["evicted_blocks"] == 6 * 4 + 60 + 2 * (512 - 64) // 16


TINY_PREFIX = ("--q", "5", "--a", "4", "--block-size", "4", "--hidden-size", "64", "--num-layers", "2",
               "--repeats", "1", "--peers", "llama.cpp")


def assert_llama_cpp(result: dict, cells: list[dict]) -> None:
    """llama.cpp ran and agreed with mmkv where `make bench-peers` installed it; else the
    benchmark says what is missing."""
    missing = llama_cpp_peer.available()
    if missing is None:
        for cell in cells:
            done, total = cell.split("/")
            assert done == total, cell
    else:
        assert result["llama_cpp"] == missing


def test_prefix_bench_computes_each_unique_token_once():
    result = bench("prefix", "--n", "3", "--p", "40", *TINY_PREFIX)
    assert result["outputs_equal"] is True  # transformers with its prefix cache reused too
    assert result["hf_prefix_reuse_seconds"] > 0 and result["speedup_vs_hf_prefix_reuse"] > 0
    assert result["computed_prefill_tokens"] == result["unique_tokens"] == 40 + 3 * 5
    assert result["kv_bytes_peak"] <= result["kv_peak_goal_bytes"]
    assert result["mmkv_bf16_seconds"] > 0 and result["bf16_sequences_equal_fp32"].endswith("/3")
    assert_llama_cpp(result, [result.get("llama_cpp_f32_sequences_equal_mmkv_fp32", "")])


def test_prefix_bench_sweep_charts_every_cell(tmp_path):
    result = bench("prefix", "--sweep", "--sweep-n", "2", "--sweep-p", "20,40",
                   "--chart", str(tmp_path / "scaling.png"), *TINY_PREFIX)
    assert result["outputs_equal"] is True and set(result["sweep"]) == {"n2_p20", "n2_p40"}
    assert all(cell["outputs_equal_hf"] and cell["outputs_equal_hf_prefix_reuse"]
               for cell in result["sweep"].values())
    assert_llama_cpp(result, [c.get("llama_cpp_sequences_equal", "") for c in result["sweep"].values()])
    assert (tmp_path / "scaling.png").stat().st_size > 0


def test_image_qa_bench_encodes_each_image_once():
    result = bench("image-qa", "--i", "2", "--q", "3", "--a", "4", "--question-tokens", "5",
                   "--hidden-size", "64", "--num-layers", "4", "--repeats", "1")
    assert result["outputs_equal"] is True  # per image, one batch of both, the cache reused
    assert result["hf_batched_seconds"] == min(result["hf_per_image_seconds"], result["hf_one_batch_seconds"])
    assert result["hf_prefix_reuse_seconds"] > 0 and result["speedup_vs_hf_prefix_reuse"] > 0
    assert result["encoder_calls"] == result["images"] == 2
    assert result["xattn_kv_bytes"] == result["xattn_kv_bytes_unique_bound"]


def test_cross_bench_answers_alike_with_the_image_groups_in_one_call_and_apart():
    """Both variants (``Engine`` and ``CrossApartEngine``) serve the scenes and answer alike."""
    result = bench("cross", "--batches", "1,2", "--requests", "2", "--batch1-requests", "1", "--repeats", "1")
    assert result["outputs_equal"] is True
    assert set(result) == {"one_call_speedup_b1", "one_call_speedup_b2", "outputs_equal"}


def test_image_qa_bench_on_qwen2_5_vl_computes_each_image_once():
    result = bench("image-qa", "--family", "qwen2_5_vl", "--i", "2", "--q", "3", "--a", "4",
                   "--question-tokens", "5", "--hidden-size", "64", "--num-layers", "2",
                   "--image-size", "112", "--repeats", "2")
    assert result["outputs_equal"] is True
    assert result["encoder_calls"] == result["images"] == 2
    # A prompt is <|vision_start|>, 16 image tokens, <|vision_end|> and 5 question tokens; each
    # image's first question computes all 23, the two others read the first block (16) from it.
    assert result["prompt_tokens"] == 2 * 3 * 23
    assert result["computed_prefill_tokens"] == 2 * (23 + 2 * (23 - 16))


# Pass costs the controller is told instead of what each pass took (seconds by kind): with
# drafts nearly free beside a target pass, every round pays; with drafts dearer than any round
# could save, none does. Either way the controller's choices follow from these costs alone, not
# from how busy the machine is.
SCRIPTED_PASS_SECONDS = {
    "speculate": {"plain": 1.0, "verify": 1.0, "first_draft": 1e-4, "draft": 1e-4, "catch_up": 1e-4},
    "plain": {"plain": 1.0, "verify": 1.0, "first_draft": 100.0, "draft": 100.0, "catch_up": 100.0},
}


@pytest.mark.parametrize("forced, loads", [("speculate", ("mixed",)), ("plain", ("summaries",))])
def test_spec_bench_runs_the_bundled_pair_whatever_the_controller_decides(tmp_path, monkeypatch, forced, loads):
    """One workload of the four each: ``mixed`` (scenes, with their images, and summaries) where
    rounds pay, ``summaries`` (what transformers also serves) where nothing is drafted once the
    controller has explored. The
    controller is told scripted pass costs (``SCRIPTED_PASS_SECONDS``), so whether its cells
    speculate is decided by the test, not by the machine's load; fixed rounds draft every step
    either way."""
    seconds = SCRIPTED_PASS_SECONDS[forced]
    observe = DraftLengthController.observe_pass
    monkeypatch.setattr(DraftLengthController, "observe_pass",
                        lambda self, kind, rows, context, _, sequences=None:
                        observe(self, kind, rows, context, seconds[kind], sequences))
    result = bench("spec", "--requests", "2", "--batch1-requests", "1", "--batches", "1,2",
                   "--loads", ",".join(loads), "--regimes", "greedy", "--chart", str(tmp_path / "speedup.png"),
                   "--adaptive-threshold", "0.4", "--repeats", "1", "--seconds", "0")
    assert result["outputs_equal"] is True
    cells = [f"{name}_{load}_b{b}" for name in ("early_exit", "draft")
             for load in loads for b in (1, 2)]
    assert not any(f"_{load}_" in key for key in result for load in spec_bench.LOADS if load not in loads)
    assert result["min_speedup"] == min(result[f"speedup_{cell}"] for cell in cells) > 0
    assert result["held_out_cells"] == sorted(c for c in cells if c.endswith("_b2"))  # batch 2: not tuned
    assert result["min_speedup_tuned"] == min(result[f"speedup_{c}"] for c in cells if c.endswith("_b1"))
    versus = {cell: round(min(result[f"speedup_{cell}"], result[f"controller_vs_fixed_{cell}"]), 3)
              for cell in cells}
    assert all(result[f"controller_vs_best_fixed_{cell}"] == v for cell, v in versus.items())
    assert all(result[f"fixed_{cell}"] > 0 for cell in cells)
    assert result["controller_vs_best_fixed_min"] == min(versus.values())
    # a pair of rounds per workload: each engine leads one
    assert result["rounds_b1"] == result["rounds_b2"] == {load: 2 for load in loads}
    for name in ("early_exit", "draft"):  # the engines learn their pass costs as they run: nothing to pay first
        assert result[f"calibration_seconds_{name}_b1"] == 0
        assert result[f"speedup_{name}_b1_with_calibration"] == result[f"speedup_{name}_b1"]
    if forced == "speculate":
        for name in ("early_exit", "draft"):
            assert result[f"mean_tokens_per_round_{name}_b1"] >= 1
        assert 0 < result["acceptance_rate_early_exit_mixed_b1"] <= 1
    else:  # the controller's cells explored (a round or two) and then decoded plainly
        assert all(result[f"zero_draft_fraction_{cell}"] >= 0.5 for cell in cells), result
    for name in ("early_exit", "draft"):
        # not at least plain's: a round can end one sequence steps before plain decoding would,
        # freeing its blocks before the other's peak (the draft model's engine read 15 to 16)
        assert result[f"peak_blocks_{name}_b2"] > 0 and result["peak_blocks_plain_b2"] > 0
    assert result["draft_extra_blocks_early_exit"] == (result["peak_blocks_early_exit_b2"]
                                                       - result["peak_blocks_plain_b2"])
    assert (tmp_path / "speedup.png").stat().st_size > 0
    floor = [result[f"plain_vs_plain_{load}_b{b}"] for load in loads for b in (1, 2)]
    assert result["plain_vs_plain_range"] == [min(floor), max(floor)] and min(floor) > 0
    assert all(result[f"decode_speedup_{cell}"] > 0 for cell in cells)
    assert 0 < result["prefill_share_plain_b1"] < 1 and 0 < result["prefill_share_plain_b2"] < 1


def test_spec_bench_reports_the_held_out_regimes_apart(tmp_path, monkeypatch):
    """Sampled requests and requests arriving into a running batch are cells of their own, held
    out from the tuned ones: sampled outputs are compared by their token distribution, greedy
    arrivals by token against plain decoding's."""
    seconds = SCRIPTED_PASS_SECONDS["speculate"]
    observe = DraftLengthController.observe_pass
    monkeypatch.setattr(DraftLengthController, "observe_pass",
                        lambda self, kind, rows, context, _, sequences=None:
                        observe(self, kind, rows, context, seconds[kind], sequences))
    result = bench("spec", "--requests", "3", "--batches", "2", "--loads", "summaries",
                   "--regimes", "t0.7,arrivals", "--chart", str(tmp_path / "speedup.png"),
                   "--repeats", "1", "--seconds", "0")
    assert result["outputs_equal"] is True and result["regimes"] == ["t0.7", "arrivals"]
    cells = [f"{name}_summaries_{regime}_b2" for name in ("early_exit", "draft") for regime in ("t0.7", "arrivals")]
    assert sorted(result["held_out_cells"]) == sorted(cells)
    assert result["min_speedup_held_out"] == result["min_speedup"] == min(result[f"speedup_{c}"] for c in cells)
    assert "min_speedup_tuned" not in result
    assert result["controller_vs_best_fixed_min_held_out"] == result["controller_vs_best_fixed_min"]
    for name in ("early_exit", "draft", "plain_again"):
        assert 0 <= result[f"token_tv_{name}_summaries_t0.7_b2"] <= 1
    assert not any(key.startswith("token_tv_") and "arrivals" in key for key in result)
    assert not (tmp_path / "speedup.png").exists()  # the chart draws greedy workloads only


def test_requests_arrive_three_every_two_steps_into_the_running_batch():
    """``in_turns`` with arrivals: each engine queues three prompts before its first step and
    three more before every second step after, until the stream is queued; without, a batch at
    once. A sampled regime seeds each request by its place."""
    class Recording:
        def __init__(self):
            self.queued, self.steps, self.running = [], 0, []

        def stats(self):
            return {"step_seconds_prefill": 0.0, "step_seconds_decode": 0.0}

        def add_request(self, prompt, params):
            self.queued.append((self.steps, prompt, params))
            self.running.append(types.SimpleNamespace(request_id=prompt, token_ids=[prompt], finished=True))

        def has_unfinished(self):
            return bool(self.running)

        def step(self):
            self.steps += 1
            done, self.running = self.running[:1], self.running[1:]  # one finishes a step
            return done

    params, arrivals = spec_bench.served("arrivals")
    engines = {"a": Recording(), "b": Recording()}
    runs = spec_bench.in_turns(engines, list(range(8)), 4, params=params, arrivals=arrivals)
    for engine in engines.values():
        assert [(step, prompt) for step, prompt, _ in engine.queued] == [
            (0, 0), (0, 1), (0, 2), (2, 3), (2, 4), (2, 5), (4, 6), (4, 7)]
    assert runs["a"][0] == [[i] for i in range(8)]
    at_once = {"c": Recording()}
    spec_bench.in_turns(at_once, list(range(8)), 4)
    assert [step for step, _, _ in at_once["c"].queued] == [0] * 4 + [4] * 4
    sampled, none = spec_bench.served("t0.7")
    assert none is None and (sampled(5).temperature, sampled(5).seed) == (0.7, 5)


def test_paced_arrivals_come_in_time_not_in_steps(monkeypatch):
    """With a pace, requests arrive on each engine's own clock: three every two seconds (pace 1 s)
    whether an engine's steps take 1 s, 3 s or 0.5 s. The slow engine gets more requests a step,
    and an engine that has run out of work waits for the next to arrive, the wait counted in its
    seconds."""
    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])

    class Timed:
        def __init__(self, seconds_a_step):
            self.seconds_a_step, self.queued, self.steps, self.running = seconds_a_step, [], 0, []

        def stats(self):
            return {"step_seconds_prefill": 0.0, "step_seconds_decode": 0.0}

        def add_request(self, prompt, params):
            self.queued.append((self.steps, prompt))
            self.running.append(types.SimpleNamespace(request_id=prompt, token_ids=[prompt], finished=True))

        def has_unfinished(self):
            return bool(self.running)

        def step(self):
            now[0] += self.seconds_a_step
            self.steps += 1
            done, self.running = self.running[:1], self.running[1:]
            return done

    engines = {"one": Timed(1.0), "three": Timed(3.0), "half": Timed(0.5)}
    runs = spec_bench.in_turns(engines, list(range(8)), 4, arrivals=(3, 2), pace=1.0)
    steps_at = {name: [step for step, _ in engine.queued] for name, engine in engines.items()}
    assert steps_at == {"one": [0] * 3 + [2] * 3 + [4] * 2, "three": [0] * 3 + [1] * 3 + [2] * 2,
                        "half": [0] * 3 + [3] * 3 + [6] * 2}
    assert runs["half"][1] == pytest.approx(5.0)  # waited 0.5 s twice for requests to arrive
    assert runs["three"][2]["run_steps"] == 8 and runs["one"][0] == [[i] for i in range(8)]


def test_spec_bench_refuses_an_unknown_workload():
    parser = argparse.ArgumentParser()
    spec_bench.add_arguments(parser)
    with pytest.raises(SystemExit, match="unknown workload nope"):
        spec_bench.run(parser.parse_args(["--loads", "scenes,nope"]))


def test_all_accepted_cells_are_paired_speedups_apart_from_min_speedup(monkeypatch, tmp_path):
    """``--all-accepted`` adds ``all_accepted_<method>_<cell>`` and ``_b<batch>``: plain
    decoding's time over the all-accepted runs', as the speedup cells are; ``min_speedup`` is
    over the real drafts' cells only. The decode-only cells divide the decoding steps' seconds
    alike, and the prefill share is plain decoding's prompt steps' part of its step time. (Runs
    scripted: 2 s plain, early exit 1 s and 0.5 s all accepted, the draft model 2 s and, all
    accepted, a noisy 4 s; 0.5 s of each in prompt steps.)"""
    seconds = {"plain": 2.0, "plain_again": 2.0, "early_exit": 1.0, "early_exit_all_accepted": 0.5,
               "draft": 2.0, "draft_all_accepted": 4.0, "early_exit_fixed": 0.8, "draft_fixed": 2.5}
    stats = {"spec_rounds": 1, "spec_drafted_tokens": 1, "spec_accepted_tokens": 1, "spec_decisions": 1,
             "spec_zero_drafts": 0, "spec_seq_mean_draft_length_mean": 1.0, "peak_blocks_in_use": 1}

    def run(name):
        return [[1, 2]], seconds[name], {**stats, "run_prefill_seconds": 0.5,
                                         "run_decode_seconds": seconds[name] - 0.5}

    def scripted(model, prompts, warm, batch, configs, repeats, budget, regimes):  # fixed rounds meet the controller
        return {(name, load): [(run(name), run(spec_bench.partner(name, configs)))] * 4
                for name in configs for load in prompts}

    monkeypatch.setattr(spec_bench, "interleaved", scripted)
    parser = argparse.ArgumentParser()
    spec_bench.add_arguments(parser)
    result = spec_bench.run(parser.parse_args(["--batches", "8", "--requests", "2", "--all-accepted",
                                               "--regimes", "greedy", "--chart", str(tmp_path / "chart.png")]))
    for load in ("scenes", "summaries", "short", "mixed"):
        assert result[f"all_accepted_early_exit_{load}_b8"] == 4.0
        assert result[f"all_accepted_draft_{load}_b8"] == 0.5
    assert result["all_accepted_early_exit_b8"] == 4.0 and result["all_accepted_draft_b8"] == 0.5
    assert result["min_speedup"] == 1.0 and result["min_speedup_cell"].startswith("draft_")
    for load in ("scenes", "summaries"):
        assert result[f"decode_speedup_early_exit_{load}_b8"] == 3.0
        assert result[f"decode_speedup_draft_{load}_b8"] == 1.0
    assert result["decode_speedup_early_exit_b8"] == 3.0 and result["prefill_share_plain_b8"] == 0.25
    # fixed rounds, met by the controller: early exit's 0.8 s beat its controller's 1 s (so 2.5x
    # plain decoding against the controller's 2x); the draft model's 2.5 s lose to its
    # controller's 2 s (0.8x plain decoding), and the controller matches plain decoding
    assert result["controller_vs_fixed_early_exit_short_b8"] == 0.8
    assert result["controller_vs_fixed_draft_short_b8"] == 1.25
    assert result["fixed_early_exit_short_b8"] == 2.5 and result["fixed_draft_short_b8"] == 0.8
    assert result["controller_vs_best_fixed_early_exit_scenes_b8"] == 0.8
    assert result["controller_vs_best_fixed_draft_summaries_b8"] == 1.0
    assert result["controller_vs_best_fixed_min"] == 0.8
    assert result["controller_vs_best_fixed_min_cell"].startswith("early_exit_")


def _shares_a_block(warm: list[int], prompts: list[list[int]], block: int = 16) -> bool:
    """Whether ``warm`` and a prompt begin with the same ``block`` tokens (the least the cache can
    hand from one request to another)."""
    return any(len(p) >= block and warm[:block] == p[:block] for p in prompts)


def test_no_warm_up_shares_a_block_or_an_image_with_its_workload():
    """An engine's warm-up request leaves its K/V (and its images' encoder output) cached: every
    benchmark warms up on a prompt its run never serves, so no timed request meets a warm cache."""
    from transformers import AutoTokenizer

    from mmkv.bench import image_qa_bench, prefix_bench, serve_bench

    encode = AutoTokenizer.from_pretrained(spec_bench.BUNDLED_MODEL).encode
    _, prompts = prefix_bench.workload(16, 600, 20, 0)
    assert not _shares_a_block(prefix_bench.WARM_UP, prompts)
    questions = [image_qa_bench.IMAGE_PREFIX[f] + [4] * 12 for f in image_qa_bench.FAMILIES]
    assert not _shares_a_block(image_qa_bench.WARM_UP, questions)  # and it carries no image
    texts = serve_bench.workload(3, 2, 200)
    assert not _shares_a_block(encode(serve_bench.warm_up_prompt(200)), [encode(t) for t in texts])
    loads, warm = spec_bench.workloads(32, 11), spec_bench.warm_ups(11)
    assert set(warm) == set(loads)
    assert not _shares_a_block(encode(warm["summaries"][0]), [encode(t) for t in loads["summaries"]])
    for load in ("scenes", "short", "mixed"):  # each warm-up a scene the workload never shows
        pixels = {p["images"][0].tobytes() for p in loads[load] if isinstance(p, dict)}
        assert warm[load][0]["images"][0].tobytes() not in pixels
    texts = [t for t in loads["short"] if isinstance(t, str)]
    assert texts and not _shares_a_block(encode(warm["summaries"][0]), [encode(t) for t in texts])


@pytest.mark.parametrize("method", ["early_exit", "draft_model"])
def test_an_all_accepted_run_accepts_every_draft_and_keeps_the_outputs(method):
    """``--all-accepted`` drafts the target's own tokens (each round's pass i proposes the token i
    past the sequence's end): every draft is accepted and the outputs are plain decoding's, here
    taking turns step by step with a plain engine that gives them too. Each run's step seconds
    leave its engine's warm-up out: they fit in the run's own time."""
    prompts = spec_bench.workloads(3, 11)["summaries"]
    warm_up = spec_bench.warm_ups(11)["summaries"]
    own = spec_bench.own_outputs(spec_bench.BUNDLED_MODEL, warm_up, prompts, 2)
    config = SpeculativeConfig(method=method, num_tokens=6, draft_length="fixed",
                               draft_model=spec_bench.BUNDLED_DRAFT_MODEL if method == "draft_model" else None)
    engines = {"all_accepted": spec_bench.fresh_engine(spec_bench.BUNDLED_MODEL, warm_up, 2, config, own),
               "plain": spec_bench.fresh_engine(spec_bench.BUNDLED_MODEL, warm_up, 2, None)}
    runs = spec_bench.in_turns(engines, prompts, 2)
    for outs, seconds, stats in runs.values():
        assert outs == list(own.values())
        assert 0 < stats["run_prefill_seconds"] and 0 < stats["run_decode_seconds"]
        assert stats["run_prefill_seconds"] + stats["run_decode_seconds"] <= seconds
    stats = runs["all_accepted"][2]
    assert stats["spec_drafted_tokens"] > 20
    assert stats["spec_accepted_tokens"] == stats["spec_drafted_tokens"]


def test_spec_compare_runs_the_new_engine_on_its_settings(monkeypatch):
    """``bench spec-compare``: on frozen pass costs where rounds pay (so nothing rests on live
    timings), the default engine drafts and one with a round margin of 100 does not; the outputs
    stay plain decoding's. A setting that does not exist is refused naming it."""
    fresh = spec_compare.fresh_engine

    def frozen(*args, **kwargs):
        engine = fresh(*args, **kwargs)
        if engine.speculator is not None:
            freeze_costs(engine, draft=lambda r: 0.01 + 1e-5 * r, verify=lambda r: 1 + 1e-4 * r)
        return engine

    monkeypatch.setattr(spec_compare, "fresh_engine", frozen)
    parser = argparse.ArgumentParser()
    spec_compare.add_arguments(parser)
    result = spec_compare.run(parser.parse_args(["--batch", "2", "--requests", "2", "--rounds", "1",
                                                 "--load", "scenes", "--set", "round_margin=100"]))
    assert result["outputs_equal"] and result["settings"] == {"round_margin": 100.0}
    assert result["drafted_new"] < result["drafted_old"] / 2, result
    assert len(result["new_over_old_rounds"]) == 3 and result["new_over_old"] > 0  # one led by each engine
    assert {"decode_threads_plain", "decode_threads_old", "decode_threads_new"} <= set(result)
    with pytest.raises(SystemExit, match="explores=1"):
        spec_compare.run(parser.parse_args(["--set", "explores=1"]))


@pytest.mark.parametrize("batch", [1, 8])
def test_spec_compare_serves_the_prompts_bench_spec_serves(monkeypatch, batch):
    """The same prompts in a cell of each: at batch 1 the first eight of the 32 ``bench spec``
    draws of each workload (eight drawn alone would be other prompts). Both stop at their first
    run, before any engine is built."""

    class Served(Exception):
        pass

    def first_run(engines, prompts, *_, **__):
        raise Served(prompts)

    for module in (spec_bench, spec_compare):
        monkeypatch.setattr(module, "in_turns", first_run)
        monkeypatch.setattr(module, "fresh_engine", lambda *_, **__: None)
    served = []
    for module, argv in ((spec_bench, ["--loads", "short", "--batches", str(batch), "--regimes", "greedy"]),
                         (spec_compare, ["--load", "short", "--batch", str(batch)])):
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        with pytest.raises(Served) as raised:
            module.run(parser.parse_args(argv))
        served.append(raised.value.args[0])
    assert len(served[0]) == (8 if batch == 1 else 32) and served[0] == served[1]


@pytest.mark.parametrize("seconds, rounds", [(0, 2), (10, 6), (100, 2 * spec_bench.MAX_ROUNDS)])
def test_short_runs_get_more_rounds_up_to_a_cap(monkeypatch, seconds, rounds):
    """Rounds are added while the counted runs took under ``seconds`` (two configs a round, each
    taking turns with a plain engine, 0.5 s a run: 2 s a round), never fewer than ``repeats`` and
    at most ``MAX_ROUNDS`` x ``repeats``, and in pairs (each engine leads one of a pair: 5 rounds
    take 10 s, a sixth completes the pair); the first round is not counted."""
    calls, seeds = [], []
    monkeypatch.setattr(spec_bench, "fresh_engine", lambda *args: None)
    monkeypatch.setattr(spec_bench, "in_turns", lambda engines, *args, seed, **_: calls.append(engines)
                        or seeds.append(seed) or {name: ([], 0.5, {}) for name in engines})
    pairs = spec_bench.interleaved(Path("model"), {"load": ["p"]}, {"load": ["w"]}, 1,
                                   {"plain_again": None, "other": None},
                                   repeats=2, seconds=seconds)
    assert [len(rs) for rs in pairs.values()] == [rounds, rounds]
    assert len(calls) == 2 * (rounds + 1) and all(list(c) == ["plain", n] for c, n in
                                                  zip(calls, ["plain_again", "other"] * (rounds + 1)))
    assert seeds == [r for r in range(rounds + 1) for _ in range(2)]  # each round its own step order


def test_each_workload_gets_rounds_while_its_own_runs_are_short(monkeypatch):
    """A quick workload gets more rounds than a slow one beside it (its own counted seconds, not
    theirs together), each in pairs of rounds, one led by each engine; the first round of both is
    not counted."""
    seeds: dict[str, list[int]] = {"quick": [], "slow": []}
    run_seconds = {"quick": 0.1, "slow": 4.0}
    monkeypatch.setattr(spec_bench, "fresh_engine", lambda *args: None)
    monkeypatch.setattr(spec_bench, "in_turns", lambda engines, prompts, *args, seed, **_: seeds[prompts[0]].append(seed)
                        or {name: ([], run_seconds[prompts[0]], {}) for name in engines})
    pairs = spec_bench.interleaved(Path("model"), {"quick": ["quick"], "slow": ["slow"]},
                                   {"quick": ["w"], "slow": ["w"]}, 1, {"other": None}, repeats=3, seconds=10)
    assert len(pairs["other", "slow"]) == 4  # 3 rounds took 24 s; a fourth completes the pair
    assert len(pairs["other", "quick"]) == 3 * spec_bench.MAX_ROUNDS  # 0.2 s a round: the cap
    assert seeds == {"quick": list(range(3 * spec_bench.MAX_ROUNDS + 1)), "slow": list(range(5))}


def test_fixed_rounds_take_turns_with_their_controller(monkeypatch):
    """A method's fixed rounds meet the method's own engine (the controller) head to head, and the
    pair is kept in that order (fixed rounds' run, the controller's); the others meet plain
    decoding."""
    calls = []
    monkeypatch.setattr(spec_bench, "fresh_engine", lambda model, warm, batch, config, own=None: config)
    monkeypatch.setattr(spec_bench, "in_turns", lambda engines, *args, seed, **_: calls.append(dict(engines))
                        or {name: ([], 1.0 if name.endswith("_fixed") else 2.0, {}) for name in engines})
    configs = {"m": "controller", "m_fixed": "fixed", "plain_again": None}
    pairs = spec_bench.interleaved(Path("model"), {"load": ["p"]}, {"load": ["w"]}, 1, configs,
                                   repeats=1, seconds=0)
    assert calls[:3] == [{"plain": None, "m": "controller"}, {"m": "controller", "m_fixed": "fixed"},
                         {"plain": None, "plain_again": None}]
    assert all(mine[1] == 1.0 and other[1] == 2.0 for mine, other in pairs["m_fixed", "load"])


class _Stepper:
    """An engine that takes ``steps`` steps over each batch and writes its name in ``log`` at
    each step: what ``in_turns`` needs of an engine."""

    def __init__(self, name: str, steps: int, log: list[str]) -> None:
        self.name, self.steps, self.log, self.left, self.queued = name, steps, log, 0, []

    def stats(self) -> dict:
        return {"step_seconds_prefill": 0.0, "step_seconds_decode": 0.0}

    def add_request(self, prompt, params) -> None:
        self.queued.append(prompt)
        self.left = self.steps

    def has_unfinished(self) -> bool:
        return self.left > 0

    def step(self) -> list:
        self.log.append(self.name)
        self.left -= 1
        if self.left:
            return []
        done, self.queued = self.queued, []
        return [types.SimpleNamespace(finished=True, request_id=p, token_ids=[p]) for p in done]


def test_taking_turns_draws_each_rounds_order_and_never_steps_an_engine_twice_running(monkeypatch):
    """``in_turns``: while two or more engines are live no engine steps twice in a row (a step
    right after its own finds its caches warm), engine ``seed`` leads the round (a round's leader
    runs slower), the order comes from the seed (the same seed, the same order; each round passes
    its own), and every engine serves every prompt. (The collector is left running: its full
    collection before each round costs about 0.5 s in a process holding the suite's objects.)"""
    monkeypatch.setattr(spec_bench, "gc_paused", contextlib.nullcontext)
    def order(seed: int, steps: dict[str, int]) -> list[str]:
        log: list[str] = []
        engines = {name: _Stepper(name, n, log) for name, n in steps.items()}
        runs = spec_bench.in_turns(engines, [1, 2, 3, 4], 2, seed=seed)
        assert all(outs == [[1], [2], [3], [4]] for outs, _, _ in runs.values())
        return log

    for seed in range(6):
        log = order(seed, {"a": 9, "b": 9, "c": 9})
        assert all(x != y for x, y in zip(log, log[1:]))
        assert log[0] == "abc"[seed % 3]  # each engine leads every third round
        assert order(seed, {"a": 9, "b": 9, "c": 9}) == log
    assert len({tuple(order(seed, {"a": 9, "b": 9, "c": 9})) for seed in range(6)}) > 1
    log = order(0, {"plain": 3, "spec": 6})  # the one still live steps alone
    assert log.count("plain") == log.count("spec") / 2 and log[-2:] == ["spec", "spec"]


@pytest.mark.parametrize("all_accepted", [False, True])
def test_every_speedup_divides_its_own_baseline(monkeypatch, tmp_path, all_accepted):
    """Each speedup divides the seconds of the plain run beside it, not another's (scripted:
    every config takes 1 s but ``plain_again`` 2 s; the plain runs beside the methods take 2 s,
    those beside ``plain_again`` and the all-accepted configs 4 s)."""
    def run(seconds):
        return [[1, 2]], seconds, {"spec_rounds": 1, "spec_drafted_tokens": 1, "spec_accepted_tokens": 1,
                                   "spec_decisions": 1, "spec_zero_drafts": 0, "peak_blocks_in_use": 1,
                                   "spec_seq_mean_draft_length_mean": 1.0, "run_prefill_seconds": 0.1,
                                   "run_decode_seconds": 0.5}

    def scripted(model, prompts, warm, batch, configs, repeats, budget, regimes):  # each beside its own plain run
        plain = {"plain_again": 4.0, "early_exit_all_accepted": 4.0, "draft_all_accepted": 4.0}
        return {(name, load): [(run({"plain_again": 2.0}.get(name, 1.0)), run(plain.get(name, 2.0)))] * 4
                for name in configs for load in prompts}

    monkeypatch.setattr(spec_bench, "interleaved", scripted)
    parser = argparse.ArgumentParser()
    spec_bench.add_arguments(parser)
    result = spec_bench.run(parser.parse_args(["--batches", "8", "--requests", "2", "--regimes", "greedy",
                                               "--chart", str(tmp_path / "chart.png")]
                                              + ["--all-accepted"] * all_accepted))
    assert result["speedup_draft_summaries_b8"] == 2.0 and result["plain_vs_plain_range"] == [2.0, 2.0]
    assert ("all_accepted_draft_summaries_b8" in result) == all_accepted
    if all_accepted:
        assert result["all_accepted_draft_summaries_b8"] == 4.0 and result["all_accepted_early_exit_b8"] == 4.0


def test_paired_speedup_compares_runs_of_the_same_round():
    """The machine slowed down for a round: the variant's runs beside plain decoding's still show
    it 10 % faster, where the fastest runs of each would compare a fast round with a slow one.
    Rounds count in groups in which each engine led once: a leader 4 % slower in every round
    leaves a group's mean as it was; an odd pair of rounds does not count; rounds that do not
    fill the groups are refused."""
    plain = [1.0, 1.5, 1.1, 1.2]
    variant = [p / 1.1 for p in plain]
    assert spec_bench.paired(plain, variant) == pytest.approx(1.1)
    led = [1.04, 1 / 1.04] * 2  # the variant leads the first round of each pair, then plain decoding
    assert spec_bench.paired(plain, [v * f for v, f in zip(variant, led)]) == pytest.approx(1.1)
    assert spec_bench.paired([1.0] * 6, [1.0, 1.0, 1.0, 1.0, 0.2, 0.2]) == 1.0  # one odd pair does not count
    assert spec_bench.paired([1.0] * 3, [0.5, 1.0, 2.0], engines=3) == pytest.approx(1.0)
    for base, seconds, engines in (([1.0, 1.0], [1.0], 2), ([1.0], [1.0], 2), ([1.0] * 4, [1.0] * 4, 3)):
        with pytest.raises(ValueError):
            spec_bench.paired(base, seconds, engines)


@pytest.mark.parametrize("check, message", [("outputs_equal", "outputs differ"),
                                            ("all_outputs_valid", "all_outputs_valid is false")])
def test_a_benchmark_whose_outputs_fail_a_check_exits_non_zero(monkeypatch, capsys, check, message):
    """Outputs that differ from the peer's, or a constrained output that breaks its schema
    (``all_outputs_valid``): the speed figure beside them means nothing, so the command fails."""
    failing = types.SimpleNamespace(__doc__=f"a benchmark whose {check} is false",
                                    add_arguments=lambda parser: None,
                                    run=lambda args: {check: False, "speedup": 9.0})
    monkeypatch.setitem(sys.modules, "mmkv.bench.failing_bench", failing)
    monkeypatch.setitem(bench_main.BENCHMARKS, "failing", "failing_bench")
    with pytest.raises(SystemExit, match=message):
        bench_main.main(["failing", "--json"])
    assert json.loads(capsys.readouterr().out.splitlines()[-1])[check] is False


def test_serve_bench_drives_both_servers_to_equal_answers():
    """`mmkv serve` and `transformers serve --continuous-batching` on one small document."""
    result = bench("serve", "--documents", "1", "--questions", "3", "--document-tokens", "60",
                   "--concurrency", "3", "--max-tokens", "4")
    assert result["outputs_equal"] is True and result["requests"] == 3
    for server in ("mmkv", "transformers_serve"):
        assert result[server]["request_throughput"] > 0 and result[server]["ttft_p99_ms"] > 0
    assert result["throughput_vs_transformers_serve"] > 0


def test_kv_dtype_bench_holds_more_documents_in_compressed_pools():
    """Six documents in a pool that holds three and a half in bfloat16 and all six in int8: the
    compressed variants serve the revisits from the cache, the fields the docs quote are there,
    and decode attention is timed for every format."""
    result = bench("kv-dtype", "--documents", "6", "--document-tokens", "96", "--rounds", "2",
                   "--batch", "2", "--answer", "2", "--repeats", "1", "--kv-cache-memory", str(1003520),
                   "--long-sequences", "2", "--long-context", "200", "--long-steps", "2",
                   "--peers", "llama.cpp", "--peer-documents", "2")
    # head size 32: 32 codes and a 2-byte scale against 32 bfloat16 values, per row
    assert result["bytes_per_token_bf16"] / result["bytes_per_token_bf16_int8"] == 64 / 34
    assert result["hit_rate_bf16_int8"] > result["hit_rate_bf16"]
    assert result["cached_prompt_tokens_int8_vs_bf16"] > 1
    for field in ("seconds_int8_vs_bf16", "greedy_agreement_int8", "greedy_agreement_fp8",
                  "decode_attention_int8_vs_bf16", "decode_attention_fp8_vs_bf16"):
        assert result[field] > 0, field
    missing = llama_cpp_peer.available()
    if missing is not None:
        assert result["llama_cpp"] == missing
    else:  # int8 against llama.cpp's q8_0 and f16 K/V in one run, each timed
        for kv in ("q8_0", "f16"):
            assert result[f"llama_cpp_{kv}_seconds"] > 0 and result[f"speedup_int8_vs_llama_cpp_{kv}_kv"] > 0
        assert result["peer_kv_bytes_f16"] > result["peer_kv_bytes_q8_0"]


def test_weights_bench_runs_every_variant_in_its_own_process():
    """bfloat16, int8 and int4 (and llama.cpp's four files where installed, two of them loaded by
    mmkv too) each load in a process of their own: weights and peak memory per variant, both
    workloads' times, the ratios the docs quote, and greedy agreement with bfloat16."""
    result = bench("weights", "--hidden", "128", "--layers", "2", "--prompts", "2", "--prompt-tokens",
                   "8", "--new-tokens", "4", "--prefix-requests", "2", "--prefix-tokens", "24",
                   "--suffix-tokens", "4", "--prefix-new-tokens", "3", "--repeats", "1",
                   "--peers", "llama.cpp")
    bf16, int8, int4 = (result[f"weight_bytes_{v}"] for v in ("bf16", "int8", "int4"))
    assert bf16 > int8 > int4 > 0
    for variant in ("bf16", "int8", "int4"):
        assert result[f"decode_seconds_{variant}"] > 0 and result[f"prefix_seconds_{variant}"] > 0
        assert 0 < result[f"load_rss_{variant}"] < result[f"rss_{variant}"]
    assert result["decode_int4_vs_mmkv_bf16"] > 0 and 0 <= result["greedy_agreement_int4"] <= 1
    if llama_cpp_peer.available() is None:
        assert result["decode_int4_vs_llama_cpp_q4_k_m"] > 0 and result["rss_int4_vs_llama_cpp_q4_k_m"] > 0
        for field in ("decode_gguf_q4_k_m_vs_llama_cpp", "prefix_gguf_q4_k_m_vs_llama_cpp",
                      "rss_gguf_q4_k_m_vs_llama_cpp", "decode_gguf_q8_0_vs_llama_cpp"):
            assert result[field] > 0
        assert 0 <= result["greedy_agreement_gguf_q4_k_m"] <= 1
    else:
        assert result["llama_cpp"] == llama_cpp_peer.available()


def _ends_at_once(connection) -> None:
    os._exit(3)


def test_a_variant_whose_process_dies_is_an_error_naming_it_not_a_wait():
    """A variant's process that dies (a peer built for an instruction this CPU refuses, say) ends
    the bench with an error naming it and how it ended, where the bench once waited for ever on
    its answer."""
    from mmkv.bench import weights_bench

    ended: list = []

    def call() -> None:
        try:
            weights_bench.in_process(multiprocessing.get_context("fork"), _ends_at_once)
        except RuntimeError as err:
            ended.append(str(err))

    waiter = threading.Thread(target=call, daemon=True)
    waiter.start()
    waiter.join(timeout=60)
    assert ended == ["_ends_at_once's process ended without answering (exit code 3)"]


def test_weights_bench_times_every_way_a_quantized_layer_runs():
    result = bench("weights", "--kernels", "--hidden", "128", "--layers", "1")
    ways = [f"{method}_{path}_{arithmetic}" for method in ("int8", "int4") for path in ("native", "dense")
            for arithmetic in ("bfloat16", "float32")]
    for way in ("bf16_packed", "int8_torch_int8pack", *ways):
        assert result[f"kernel_{way}_704x128_r1"] > 0 and result[f"kernel_{way}_128x352_r512"] > 0


def test_kv_dtype_bench_rotates_the_order_its_sides_take_turns_in():
    """mmkv and the llama.cpp peers alternate: each leads one round in every three, none is timed
    in a block before the others."""
    orders = rotated(["mmkv_int8", "llama_cpp_q8_0", "llama_cpp_f16"], 4)
    assert [order[0] for order in orders] == ["mmkv_int8", "llama_cpp_q8_0", "llama_cpp_f16", "mmkv_int8"]
    assert all(sorted(order) == sorted(orders[0]) for order in orders)
    for place in range(3):
        assert len({order[place] for order in orders[:3]}) == 3


def test_structured_bench_reports_the_schemas_cost_and_that_every_output_validated():
    result = bench("structured", "--requests", "4", "--batch1-requests", "2", "--repeats", "1",
                   "--max-tokens", "96")
    assert result["all_outputs_valid"] is True
    for field in ("schema_vs_free_tokens_per_s_b1", "schema_vs_free_tokens_per_s_b32",
                  "mask_us_per_token_b1", "mask_us_per_token_b32"):
        assert result[field] > 0, field




def test_penalties_bench_reports_their_cost_and_that_they_ran():
    result = bench("penalties", "--requests", "3", "--batch1-requests", "1", "--repeats", "1",
                   "--max-tokens", "96")  # the bundled model repeats itself (and is penalised) past its answer
    assert result["penalised_outputs_differ"] is True
    for label in ("b1", "b32"):
        ratio = result[f"penalised_tokens_per_s_{label}"] / result[f"free_tokens_per_s_{label}"]
        assert result[f"penalised_vs_free_tokens_per_s_{label}"] == pytest.approx(ratio, abs=2e-3)
