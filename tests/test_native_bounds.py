"""Checked inputs of the native kernels (``StepContext.check_bounds``, on in debug engines).

A corrupt page id, length or write slot raises before the kernel runs (spies prove it was not
called, and the cache is untouched); a valid batch gives the same outputs checked or not; a debug
engine's greedy generation runs every step's checks and gives the unchecked engine's tokens.

Each cache layer here is a view of blocks 1.. of a larger tensor, so an unchecked kernel given a
corrupt id one block outside the layer stays inside memory the test owns: it fails the test, not
the process."""

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from mmkv import Engine, SamplingParams
from mmkv import native as native_library
from mmkv.attention import native
from mmkv.attention.metadata import CrossBatch, OneCallCross, plan_batch
from mmkv.attention.torch_backend import TorchBackend
from mmkv.models.fused_layer import FusedDecoderLayer
from mmkv.step_context import StepContext
from tiny_models import FAMILIES, build_model

BS, HQ, HKV, D = 4, 4, 2, 8
CPU = torch.device("cpu")


class Spy:
    """Wraps a kernel and counts its calls."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, 0

    def __call__(self, *args):
        self.calls += 1
        return self.kernel(*args)


@pytest.fixture
def decode_spy(monkeypatch) -> Spy:
    real = native.kernel()
    assert real is not None
    spy = Spy(real)
    monkeypatch.setattr(native, "kernel", lambda: spy)
    return spy


def guarded_layer(blocks: int, *shape: int, generator=None) -> torch.Tensor:
    """A contiguous ``[blocks, *shape]`` layer with one guard block before and after it."""
    shape = (blocks + 2, *shape)
    backing = torch.randn(shape, generator=generator) if generator else torch.zeros(shape)
    return backing[1:-1]


def decode_step(check_bounds: bool) -> tuple[StepContext, torch.Tensor, torch.Tensor]:
    """Two decoding sequences (6 and 10 keys) over a 6-block layer, their queries."""
    g = torch.Generator().manual_seed(0)
    layer = guarded_layer(6, 2, BS, HKV, D, generator=g)
    batch = plan_batch([[0, 1], [5, 3, 4]], [1, 1], [6, 10], BS, CPU, cascade=False)
    step = StepContext(batch, [layer], TorchBackend(), check_bounds=check_bounds)
    return step, layer, torch.randn(2, HQ, D, generator=g)


def cross_step(check_bounds: bool) -> tuple[StepContext, torch.Tensor, torch.Tensor]:
    """Two query rows attending one image's 7 positions in pages 4 and 1 (one native call)."""
    g = torch.Generator().manual_seed(1)
    layer = guarded_layer(6, 2, BS, HKV, D, generator=g)
    one_call = OneCallCross(queries=torch.tensor([0, 1]), pages=torch.tensor([[4, 1]]),
                            lens=torch.tensor([7]), key_start=torch.tensor([0]),
                            positions=torch.tensor([[7, 7]]), slots=None, rows=torch.tensor([0, 1]))
    cross = CrossBatch(groups=[], row_mask=torch.ones(2), one_call=one_call)
    step = StepContext(plan_batch([[2]], [2], [2], BS, CPU), [layer], TorchBackend(), cross=cross,
                       check_bounds=check_bounds)
    return step, layer, torch.randn(2, HQ, D, generator=g)


def attend(kind: str, step: StepContext, layer: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    if kind == "cross":
        return step.backend.cross_attention(step, query, layer, D ** -0.5)
    return step.backend.attention(step, query, layer, D ** -0.5, None)


def corrupt(kind: str, step: StepContext) -> None:
    plan = step.cross.one_call if kind == "cross" else step.batch.decode[0]
    if kind == "page past the layer":
        plan.pages[1, 2] = 6
    elif kind == "negative page":
        plan.pages[0, 0] = -1
    elif kind == "length past its pages":
        plan.lens[0] = plan.pages.shape[1] * BS + 1
    else:
        plan.pages[0, 1] = 6


@pytest.mark.parametrize("kind, error, message", [
    ("page past the layer", IndexError,
     "pages[1, 2] = 6 is outside the cache layer's 6 blocks (allowed 0 <= page id < 6)"),
    ("negative page", IndexError, "pages[0, 0] = -1"),
    ("length past its pages", ValueError,
     "lens[0] = 13 is outside what its 3 pages of 4 slots hold (allowed 0 <= length <= 12)"),
    ("cross", IndexError, "pages[0, 1] = 6 is outside the cache layer's 6 blocks"),
], ids=["page-past", "page-negative", "length", "cross"])
def test_a_corrupt_page_table_raises_before_the_decode_kernel_runs(kind, error, message, decode_spy):
    """Through the torch backend (decode and cross-attention), as the layers call it."""
    make = cross_step if kind == "cross" else decode_step
    step, layer, query = make(check_bounds=True)
    want = attend(kind, step, layer, query)
    unchecked, *_ = make(check_bounds=False)
    assert torch.equal(attend(kind, unchecked, layer, query), want)  # a valid batch: the same output
    assert decode_spy.calls == 2
    corrupt(kind, step)
    with pytest.raises(error) as raised:
        attend(kind, step, layer, query)
    assert message in str(raised.value)
    assert decode_spy.calls == 2


def fused_layer_step(check_bounds: bool):
    """A tiny Llama decoder layer, fused; three new tokens of a sequence in block 2 of 3 (its
    value rows, 20-22, lie past num_blocks * block_size: the bound is the layer's rows)."""
    config = FAMILIES["llama"]()
    torch.manual_seed(0)
    fused = FusedDecoderLayer(LlamaDecoderLayer(config, layer_idx=0), pack=False)
    assert fused.rope_write is not None
    dim = config.hidden_size // config.num_attention_heads
    layer = guarded_layer(3, 2, BS, config.num_key_value_heads, dim)
    step = StepContext(plan_batch([[2]], [3], [3], BS, CPU), [layer], TorchBackend(),
                       check_bounds=check_bounds)
    angles = torch.randn(3, 1, dim)
    return fused, step, layer, (torch.randn(3, config.hidden_size), angles.cos(), angles.sin())


@pytest.mark.parametrize("slot, message", [(24, "write_slots[4] = 24 is outside the cache layer's 24 rows"),
                                           (-3, "write_slots[4] = -3")], ids=["past", "negative"])
def test_a_corrupt_write_slot_raises_before_rope_write_runs(slot, message):
    fused, step, layer, inputs = fused_layer_step(check_bounds=True)
    spy = fused.rope_write = Spy(fused.rope_write)
    want = fused(*inputs, step)
    written = layer.clone()
    assert spy.calls == 1 and step.batch.write_slots.max() >= 3 * BS
    plain, unchecked, unchecked_layer, _ = fused_layer_step(check_bounds=False)
    assert torch.equal(plain(*inputs, unchecked), want) and torch.equal(unchecked_layer, written)
    step.batch.write_slots[4] = slot
    memory = layer._base  # the layer with its guard blocks
    memory.zero_()
    with pytest.raises(IndexError) as raised:
        fused(*inputs, step)
    assert message in str(raised.value) and "(allowed 0 <= slot < 24)" in str(raised.value)
    assert spy.calls == 1 and not memory.any()


def test_a_debug_engine_checks_every_kernel_call_and_generates_the_same(tmp_path, monkeypatch):
    calls = {"check_pages": 0, "check_slots": 0}
    for name in calls:
        def counted(*args, __check=getattr(native_library, name), __name=name):
            calls[__name] += 1
            return __check(*args)
        monkeypatch.setattr(native_library, name, counted)
    path = build_model("llama", tmp_path)
    prompts = [[5, 9, 2, 7, 1], [3] * 11]
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    outputs = {}
    for debug in (False, True):
        eng = Engine(path, kv_cache_memory="4MiB", host_kv_memory="4MiB", block_size=4, device="cpu",
                     dtype="float32", debug=debug)
        outputs[debug] = [out.token_ids for out in eng.generate(prompts, greedy)]
        if not debug:
            assert calls == {"check_pages": 0, "check_slots": 0}
    assert outputs[True] == outputs[False] and all(len(t) == 6 for t in outputs[True])
    assert calls["check_pages"] > 0 and calls["check_slots"] > 0
