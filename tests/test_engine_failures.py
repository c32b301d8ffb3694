"""Requests that end early hold nothing: aborted, failed inside a step, or dropped by their caller.

The two holes these tests were written against: an exception inside a forward pass made
``generate`` re-raise while its other requests stayed queued, holding blocks (and ran silently
inside the next call); a ``stream()`` iterator dropped after two items left its request running.
"""

import pytest
import torch

from mmkv import SamplingParams
from test_engine_oracle import GREEDY, engine, prompts
from tiny_vlms import picture

POISON = 255  # a request whose prompt holds this token makes the patched forward raise


def poison_forward(eng, error: type[BaseException] = ZeroDivisionError) -> list[int]:
    """Make the model's forward raise whenever its batch holds POISON; returns a list that
    counts the calls that raised."""
    forward = eng.model.forward
    raised: list[int] = []

    def patched(input_ids, step, rows):
        if bool((input_ids == POISON).any()):
            raised.append(len(input_ids))
            raise error("poisoned batch")
        return forward(input_ids, step, rows)

    eng.model.forward = patched
    return raised


def assert_idle_and_clean(eng) -> None:
    assert not eng.has_unfinished()
    assert eng.stats()["blocks_in_use"] == 0
    eng.check_integrity()


def test_a_failing_forward_fails_its_request_alone_and_generate_leaves_nothing(model_dirs, hf_oracle):
    eng = engine(model_dirs)
    good = prompts(40, [9, 21, 14])
    bad = prompts(41, [12])[0][:6] + [POISON] + prompts(41, [12])[0][6:]
    raised = poison_forward(eng)
    with pytest.raises(RuntimeError, match=r"request 1 failed: ZeroDivisionError: poisoned batch"):
        eng.generate([good[0], bad, good[1], good[2]], GREEDY)
    assert raised and not eng.has_unfinished()
    assert_idle_and_clean(eng)
    outs = eng.generate(good, GREEDY)  # nothing of the failed call runs inside this one
    assert [o.token_ids for o in outs] == [hf_oracle("llama", p, 16) for p in good]
    returned = eng.generate([good[0], bad, good[2]], GREEDY, errors="return")
    assert "ZeroDivisionError: poisoned batch" in returned[1].error and returned[1].finished
    assert returned[0].token_ids == hf_oracle("llama", good[0], 16) and returned[0].error is None
    assert returned[2].token_ids == hf_oracle("llama", good[2], 16) and returned[2].error is None
    assert_idle_and_clean(eng)


def test_step_api_reports_the_failed_request_and_runs_the_others(model_dirs, hf_oracle):
    eng = engine(model_dirs)
    good = prompts(42, [10, 17])
    ids = [eng.add_request(p, GREEDY) for p in good]
    eng.step()
    poison_forward(eng)
    bad_id = eng.add_request([POISON] * 5, GREEDY)
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert done[bad_id].error is not None and done[bad_id].token_ids == []
    assert [done[i].token_ids for i in ids] == [hf_oracle("llama", p, 16) for p in good]
    assert_idle_and_clean(eng)


def test_a_row_with_nothing_to_sample_fails_its_request_alone(model_dirs):
    """The sampled rows of a step are drawn together; a row whose logits are not a distribution
    (NaN here, as an overflowing model gives) fails its own request, and the other requests of
    the step, sampled and greedy, draw what they draw without it."""
    eng = engine(model_dirs)
    good = prompts(43, [9, 14])
    bad = prompts(44, [7])[0] + [POISON]
    sampled = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.9, seed=5)
    want = [o.token_ids for o in eng.generate([good[0], good[1]], [sampled, GREEDY])]
    forward = eng.model.forward

    def patched(input_ids, step, rows):
        logits = forward(input_ids, step, rows)
        with torch.inference_mode():
            logits[input_ids[rows[:len(logits)]] == POISON] = float("nan")
        return logits

    eng.model.forward = patched
    outs = eng.generate([good[0], bad, good[1]], [sampled, sampled, GREEDY], errors="return")
    assert "no token of positive, finite probability" in outs[1].error
    assert [outs[0].token_ids, outs[2].token_ids] == want
    assert_idle_and_clean(eng)


def test_an_interrupt_inside_generate_aborts_its_requests(model_dirs, hf_oracle):
    eng = engine(model_dirs)
    batch = prompts(43, [11, 25]) + [[POISON, 1, 2]]
    poison_forward(eng, KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        eng.generate(batch, GREEDY)
    assert_idle_and_clean(eng)


def test_a_dropped_or_broken_stream_aborts_its_request(model_dirs, hf_oracle):
    eng = engine(model_dirs)
    [prompt] = prompts(44, [30])
    stream = eng.stream(prompt, SamplingParams(max_tokens=32, ignore_eos=True))
    assert len(next(stream).token_ids) == 1 and len(next(stream).token_ids) == 2
    assert eng.stats()["blocks_in_use"] > 0
    del stream
    assert_idle_and_clean(eng)
    with pytest.raises(LookupError):
        for out in eng.stream(prompt, GREEDY):
            if len(out.token_ids) == 3:
                raise LookupError("the consumer gave up")
    assert_idle_and_clean(eng)
    assert eng.generate([prompt], GREEDY)[0].token_ids == hf_oracle("llama", prompt, 16)


def test_abort_frees_running_waiting_swapped_and_forked_requests(model_dirs, hf_oracle):
    eng = engine(model_dirs, blocks=24, max_num_seqs=2)
    batch = prompts(45, [20, 18, 22, 16])
    params = [GREEDY, SamplingParams(max_tokens=16, ignore_eos=True, n=3, temperature=0.8, seed=3),
              GREEDY, GREEDY]
    ids = [eng.add_request(p, q) for p, q in zip(batch, params)]
    for _ in range(3):
        eng.step()
    assert eng.abort(ids[1]) is True  # running, forked into three samples
    assert eng.abort(ids[3]) is True  # still waiting (max_num_seqs=2)
    assert eng.abort(ids[3]) is False and eng.abort(12345) is False
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
    assert done == {ids[0]: hf_oracle("llama", batch[0], 16), ids[2]: hf_oracle("llama", batch[2], 16)}
    assert_idle_and_clean(eng)


def test_abort_of_a_swapped_request(model_dirs, hf_oracle):
    eng = engine(model_dirs, blocks=24, preemption="swap")
    batch = prompts(7, [20, 18, 22, 16, 19])  # 5 x ~9 blocks needed, 24 available
    ids = [eng.add_request(p, GREEDY) for p in batch]
    while not eng.scheduler.swapped:
        eng.step()
    victim = eng.scheduler.swapped[0].request_id
    assert eng.abort(victim)
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
    assert done == {i: hf_oracle("llama", p, 16) for i, p in zip(ids, batch) if i != victim}
    assert_idle_and_clean(eng)


def test_an_image_whose_encoder_fails_fails_alone(vlm_dirs):
    """A request's images are encoded on the encoder worker before it is admitted: an encoder that
    raises there fails that request, and the others (same batch) finish with their own answers."""
    from mmkv import Engine

    eng = Engine(vlm_dirs["mmkv_vlm"], kv_cache_memory="8MiB", host_kv_memory="1MiB",
                 block_size=4, device="cpu", debug=True)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    good, bad = picture(1), picture(2, size=(31, 17))
    want = [o.token_ids for o in eng.generate([{"prompt": "<image>what?", "images": [good]},
                                               {"prompt": "<image>where?", "images": [good]}], params)]
    eng = Engine(vlm_dirs["mmkv_vlm"], kv_cache_memory="8MiB", host_kv_memory="1MiB",
                 block_size=4, device="cpu", debug=True)
    encode = eng.model.vision.encoder.encode
    bad_uid = eng.model.vision.prepare([bad])[0].uid

    def failing_encode(inputs):
        if eng.model.vision.registry.identify(inputs, eng.model.vision.encoder.identity)[0] == bad_uid:
            raise torch.cuda.OutOfMemoryError("encoder failed on this image")
        return encode(inputs)

    eng.model.vision.encoder.encode = failing_encode
    outs = eng.generate([{"prompt": "<image>what?", "images": [good]},
                         {"prompt": "<image>what?", "images": [bad]},
                         {"prompt": "<image>where?", "images": [good]}], params, errors="return")
    assert "encoder failed on this image" in outs[1].error
    assert [outs[0].token_ids, outs[2].token_ids] == want
    assert_idle_and_clean(eng)
