"""Images are encoded on a worker thread while the engine steps the other sequences.

The encoder is held at a gate the test opens, so what is asserted is which steps ran while an
encoding was pending, never how long anything took: a running sequence gets a token in every
such step, the request with the image joins once its encoding is done, and its answer, its
``images_encoded`` and the encoder's calls are those of an engine that encoded inline.
"""

from __future__ import annotations

import threading

import pytest

from mmkv import SamplingParams
from test_multimodal import q, vlm_engine
from tiny_vlms import picture

TEXT = SamplingParams(max_tokens=40, ignore_eos=True)
IMAGE = SamplingParams(max_tokens=6, ignore_eos=True)
PENDING_STEPS = 5


def gated(eng, fail: bool = False) -> threading.Event:
    """Make ``eng``'s encoder wait for the returned event (at most 5 s) before each encoding,
    then raise instead when ``fail``."""
    encoder = eng.model.vision.encoder
    forward, gate = encoder._forward, threading.Event()

    def waiting_forward(inputs):
        gate.wait(timeout=5)
        if fail:
            raise RuntimeError("the encoder failed on this image")
        return forward(inputs)

    encoder._forward = waiting_forward
    return gate


def run_to_end(eng, most_steps: int = 200) -> dict:
    """The finished outputs of every step until none is left (at most ``most_steps`` steps)."""
    done = {}
    for _ in range(most_steps):
        if not eng.has_unfinished():
            return done
        done.update({o.request_id: o for o in eng.step() if o.finished})
    raise AssertionError(f"requests still unfinished after {most_steps} steps")


@pytest.mark.parametrize("family", ["llava", "mllama"])
def test_a_running_sequence_decodes_while_two_requests_wait_for_one_encoding(vlm_dirs, family):
    """LLaVA's images sit in the prompt, Mllama's in cross-attention K/V: either way, while the
    image is being encoded the running text sequence gets a token every step and the two
    requests with that image wait; the image is encoded once, for the request that asked first,
    and both answers equal those of an engine that encoded inline (idle, it waits for the
    encoder)."""
    text, image = list(b"a plain text prompt of some length"), picture(11)
    asks = [{"prompt": q("What is it?"), "images": [image]}, {"prompt": q("Where?"), "images": [image]}]
    want = [o.token_ids for o in vlm_engine(vlm_dirs, family).generate([text, *asks], [TEXT, IMAGE, IMAGE])]

    eng = vlm_engine(vlm_dirs, family)
    gate = gated(eng)
    text_id = eng.add_request(text, TEXT)
    eng.step()
    ids = [eng.add_request(a, IMAGE) for a in asks]
    for _ in range(PENDING_STEPS):
        progressed = {o.request_id for o in eng.step()}
        assert progressed == {text_id}, progressed
    gate.set()
    done = run_to_end(eng)
    assert [done[i].token_ids for i in (text_id, *ids)] == want
    assert [done[i].reuse.images_encoded for i in ids] == [1, 0]
    assert eng.stats()["encoder_calls"] == 1 and eng.model.vision.num_held == 0


def test_a_failed_encoding_fails_its_request_alone(vlm_dirs):
    """An encoder that raises on the worker fails the request waiting for it (its error says
    why) and holds nothing; the running sequence finishes with its own answer."""
    text = list(b"a plain text prompt of some length")
    want = vlm_engine(vlm_dirs, "llava").generate([text], TEXT)[0].token_ids
    eng = vlm_engine(vlm_dirs, "llava")
    gate = gated(eng, fail=True)
    text_id = eng.add_request(text, TEXT)
    eng.step()
    image_id = eng.add_request({"prompt": q("What is it?"), "images": [picture(12)]}, IMAGE)
    eng.step()
    gate.set()
    done = run_to_end(eng)
    assert "the encoder failed on this image" in done[image_id].error
    assert done[text_id].token_ids == want
    assert eng.stats()["blocks_in_use"] == 0 and eng.model.vision.num_held == 0


def test_aborting_a_request_whose_image_is_encoding_leaves_nothing_held(vlm_dirs):
    """A request aborted while its image encodes holds nothing from then on; the finished
    encoding still goes to the embedding cache, so the next request with the image encodes
    nothing."""
    eng = vlm_engine(vlm_dirs, "llava")
    gate = gated(eng)
    text_id = eng.add_request(list(b"a plain text prompt of some length"), TEXT)
    eng.step()
    ask = {"prompt": q("What is it?"), "images": [picture(13)]}
    image_id = eng.add_request(ask, IMAGE)
    eng.step()
    assert eng.abort(image_id)
    gate.set()
    assert set(run_to_end(eng)) == {text_id}
    assert eng.model.vision.num_held == 0 and eng.stats()["blocks_in_use"] == 0
    again = eng.generate([ask], IMAGE)[0]
    assert again.reuse.images_encoded == 0 and eng.stats()["encoder_calls"] == 1
