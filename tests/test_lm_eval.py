"""lm-evaluation-harness as a client of ``mmkv serve``: the acceptance test of ``echo`` and prompt
log-probabilities.

A local multiple-choice task (loglikelihood requests: ``/v1/completions`` with ``echo``,
``logprobs=1``) and a local generation task (``generate_until``), both under ``tests/lm_eval_tasks``
with no network, run through lm-eval's ``local-completions`` model against the server on a tiny
random Llama, and through lm-eval's own ``hf`` model on the same weights in fp32: every
loglikelihood agrees within 1e-4, the accuracy is the same and the generations are equal. The
bundled model (which transformers cannot load) answers its own task, which value a report states:
lm-eval's loglikelihoods are the offline engine's prompt logprobs, and it picks the stated value.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from mmkv import Engine
from server_harness import MODEL_NAME, start_server

lm_eval = pytest.importorskip("lm_eval")
TASKS = Path(__file__).with_name("lm_eval_tasks")


def evaluate(model: str, model_args: str, tasks: tuple[str, ...] = ("tiny_choice", "tiny_generate")) -> dict:
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=list(tasks),
                                   task_manager=TaskManager(include_path=str(TASKS)), log_samples=True,
                                   batch_size=1, random_seed=0, numpy_random_seed=0, torch_random_seed=0)


def per_sample(result: dict, task: str) -> list:
    return [s["filtered_resps"] for s in sorted(result["samples"][task], key=lambda s: s["doc_id"])]


def with_end_token(source: Path, target: Path) -> Path:
    """The tiny Llama with an end-of-text token (lm-eval's ``hf`` model needs one): its
    character tokenizer's "\x03"."""
    shutil.copytree(source, target)
    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.eos_token = "\x03"
    tokenizer.save_pretrained(target)
    return target


def test_lm_eval_scores_the_served_model_as_it_scores_transformers(model_dirs, tmp_path, monkeypatch):
    path = with_end_token(model_dirs["llama"], tmp_path / "llama")
    monkeypatch.chdir(TASKS)  # the tasks name their data files relative to themselves
    server = start_server(Engine(path, device="cpu", debug=True))
    try:
        served = evaluate("local-completions", f"model={MODEL_NAME},base_url={server.url}/v1/completions,"
                                               f"tokenizer={path},tokenizer_backend=huggingface,"
                                               "num_concurrent=1,max_retries=1")
    finally:
        server.stop()
        server.engine.check_integrity()
    reference = evaluate("hf", f"pretrained={path},dtype=float32,device=cpu")
    got, want = per_sample(served, "tiny_choice"), per_sample(reference, "tiny_choice")
    assert len(got) == len(want) == 8
    for mine, theirs in zip(got, want):
        assert [ll for ll, _ in mine] == pytest.approx([ll for ll, _ in theirs], abs=1e-4)
    worst = max(abs(a[0] - b[0]) for mine, theirs in zip(got, want) for a, b in zip(mine, theirs))
    print(f"largest loglikelihood difference from lm-eval's hf model: {worst:.1e}")  # shown with -s
    assert served["results"]["tiny_choice"]["acc,none"] == reference["results"]["tiny_choice"]["acc,none"]
    assert per_sample(served, "tiny_generate") == per_sample(reference, "tiny_generate")


def test_lm_eval_scores_the_bundled_model_on_its_own_task(monkeypatch):
    from mmkv import SamplingParams
    from mmkv.bundled import BUNDLED_MODEL

    monkeypatch.chdir(TASKS)
    server = start_server(Engine(BUNDLED_MODEL, debug=True))
    try:
        result = evaluate("local-completions", f"model={MODEL_NAME},base_url={server.url}/v1/completions,"
                                               f"tokenizer={BUNDLED_MODEL},tokenizer_backend=huggingface,"
                                               "num_concurrent=1,max_retries=1", ("bundled_reports",))
    finally:
        server.stop()
        server.engine.check_integrity()
    assert result["results"]["bundled_reports"]["acc,none"] == 1.0
    offline, tokenizer = Engine(BUNDLED_MODEL), AutoTokenizer.from_pretrained(BUNDLED_MODEL)
    [sample] = [s for s in result["samples"]["bundled_reports"] if s["doc_id"] == 0]
    for (context, continuation), (ll, _) in zip(sample["arguments"], sample["filtered_resps"]):
        whole = tokenizer.encode(context[0] + continuation[0] if isinstance(context, list) else context + continuation)
        start = len(tokenizer.encode(context[0] if isinstance(context, list) else context))
        scored = offline.generate(whole, SamplingParams(max_tokens=0, prompt_logprobs=0))[0].prompt_logprobs
        assert ll == pytest.approx(sum(lp.logprob for lp in scored[start:]), abs=1e-4)
