"""FlashInfer's kernels on a GPU against the torch backend, pattern by pattern and through the
engine (run by ``tests/gpu/run_device_checks.sh``; skipped where there is no CUDA device).

Per pattern, on the same paged bfloat16 cache: FlashInfer's output against the torch backend's
computed in float32 from the same bfloat16 values, within bfloat16 rounding; K/V writes bit for
bit. Through the engine (bfloat16, head_dim 64): the FlashInfer and torch backends' greedy tokens,
each within near-ties of transformers' float32 argmax (``devices.py``), on a 2-layer and an 8-layer
Llama with prefix hits and cascade, and on a cross-attention VLM, with and without early-exit
speculation.
"""

import random
from collections import Counter

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU: run tests/gpu/run_device_checks.sh on one", allow_module_level=True)

from devices import assert_near_greedy, assert_within_near_ties  # noqa: E402
from mmkv import Engine, SamplingParams  # noqa: E402
from mmkv.attention.flashinfer_backend import FlashInferBackend, check_supported  # noqa: E402
from mmkv.attention.metadata import CrossSequence, plan_batch, plan_cross  # noqa: E402
from mmkv.attention.torch_backend import TorchBackend, attention, cross_attention, write_kv  # noqa: E402
from mmkv.models import MmkvVLM  # noqa: E402
from mmkv.step_context import StepContext  # noqa: E402
from speculative import SpeculativeConfig  # noqa: E402
from tiny_models import LEARNING, build_model, load_hf  # noqa: E402
from tiny_vlms import IMAGE_TOKEN, build_mmkv_vlm, mmkv_vlm_logits, picture  # noqa: E402

CUDA = torch.device("cuda")
BF16 = torch.bfloat16
PAGE, HQ, HKV = 16, 8, 2
TOL = dict(atol=2e-2, rtol=2e-2)  # bfloat16 outputs (8 bits of mantissa) of unit-scale values
HEAD64 = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


class CountingBackend(FlashInferBackend):
    """The FlashInfer backend on the GPU, counting the calls it makes."""

    def __init__(self) -> None:
        super().__init__(CUDA)
        self.calls: Counter[str] = Counter()

    def _call(self, call, wrapper=None):
        self.calls[call.target] += 1
        return super()._call(call, wrapper)


# -- one pattern at a time ----------------------------------------------------------------------

def paged(seqs, head_dim, seed=0, cascade=True):
    """A bfloat16 cache holding ``seqs`` (kv_len, new tokens, parent or None, tokens shared with the
    parent), the step's metadata, its new K/V and queries."""
    g = torch.Generator(device=CUDA).manual_seed(seed)
    pages = sum(-(-n // PAGE) for n, *_ in seqs)
    layer = torch.zeros(pages + 1, 2, PAGE, HKV, head_dim, dtype=BF16, device=CUDA)
    free, tables = iter(range(pages + 1)), []
    for n, _, parent, shared in seqs:
        table = tables[parent][:shared // PAGE] if parent is not None else []
        table = table + [next(free) for _ in range(-(-n // PAGE) - len(table))]
        tables.append(table)
    layer.normal_(generator=g)
    q_lens = [q for _, q, _, _ in seqs]
    batch = plan_batch(tables, q_lens, [n for n, *_ in seqs], PAGE, CUDA, cascade=cascade)
    t = sum(q_lens)
    new = [torch.randn(t, HKV, head_dim, generator=g, device=CUDA) for _ in range(2)]  # float32: cast on write
    return layer, batch, *new, torch.randn(t, HQ, head_dim, generator=g, device=CUDA).to(BF16)


SHARED = [(600, 1, None, 0)] + [(600 + 7 * i, 1, 0, 592) for i in range(1, 40)]
CASES = {
    "mixed": [(300, 300, None, 0), (40, 20, None, 0), (190, 1, None, 0), (210, 1, 2, 176),
              (170, 1, 2, 160), (220, 6, 2, 208), (190, 25, 2, 160), (9, 1, None, 0)],
    "decode": [(190, 1, None, 0), (210, 1, 0, 176), (1000, 1, None, 0), (17, 1, 0, 16), (1, 1, None, 0)],
    "shared_decode": SHARED,  # every row in one cascade group
    "shared_verify": [(n + 5, 6, p, s) for n, _, p, s in SHARED[:12]],  # speculative verification
}


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("case, cascade", [("mixed", False), ("mixed", True), ("decode", False),
                                           ("shared_decode", True), ("shared_decode", False),
                                           ("shared_verify", True)])
def test_self_attention_pattern_matches_the_torch_backend(case, cascade, head_dim):
    layer, batch, key, value, query = paged(CASES[case], head_dim, cascade=cascade)
    scale = head_dim ** -0.5
    want_layer = layer.clone()
    write_kv(want_layer, batch, key.to(BF16), value.to(BF16))
    backend = CountingBackend()
    step = StepContext(batch, [layer], backend)
    backend.write_kv(step, layer, key, value)
    assert torch.equal(layer, want_layer), "append_paged_kv_cache wrote elsewhere than write_kv"
    got = backend.attention(step, query, layer, scale, None)
    want = attention(query.float(), layer.float(), batch, scale)
    torch.testing.assert_close(got.float(), want, **TOL)
    assert (backend.calls["merge_state"] > 0) == bool(batch.cascade_groups)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_cross_attention_matches_the_torch_backend(head_dim):
    """Rows that see different image positions (a custom mask) and rows without images."""
    seqs = [CrossSequence(rows=list(range(0, 40)), positions=list(range(40)), prompt_len=40,
                          images=[([3, 4, 5], 40, 33, 2, None)]),
            CrossSequence(rows=[40], positions=[70], prompt_len=9, images=[]),
            CrossSequence(rows=list(range(41, 61)), positions=list(range(20)), prompt_len=30,
                          images=[([3, 4, 5], 40, 33, 0, 12), ([6, 7], 20, 20, 12, None)]),
            CrossSequence(rows=[61, 62], positions=[50, 51], prompt_len=40,
                          images=[([3, 4, 5], 40, 33, 2, None)])]
    g = torch.Generator(device=CUDA).manual_seed(1)
    layer = torch.randn(10, 2, PAGE, HKV, head_dim, generator=g, device=CUDA).to(BF16)
    query = torch.randn(63, HQ, head_dim, generator=g, device=CUDA).to(BF16)
    for subset in (seqs, seqs[1:2] + seqs[3:]):  # with and without a custom mask
        cross = plan_cross(subset, 63, PAGE, CUDA, BF16)
        backend = CountingBackend()
        step = StepContext(plan_batch([[0]], [1], [1], PAGE, CUDA), [layer], backend, cross=cross)
        got = backend.cross_attention(step, query, layer, head_dim ** -0.5)
        want = cross_attention(query.float(), layer.float(), cross, head_dim ** -0.5)
        torch.testing.assert_close(got.float(), want, **TOL)


def test_image_kv_writes_equal_the_torch_backend():
    g = torch.Generator(device=CUDA).manual_seed(2)
    k, v = (torch.randn(40, HKV, 64, generator=g, device=CUDA) for _ in range(2))
    want, got = (torch.zeros(8, 2, PAGE, HKV, 64, dtype=BF16, device=CUDA) for _ in range(2))
    TorchBackend().write_image_kv(want, [5, 2, 7], 17, k[17:], v[17:])
    FlashInferBackend(CUDA).write_image_kv(got, [5, 2, 7], 17, k[17:], v[17:])
    assert torch.equal(got, want)


# -- through the engine -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpu_dirs(tmp_path_factory):
    """Tiny random models whose head_dim (64) FlashInfer serves."""
    root = tmp_path_factory.mktemp("gpu_models")
    dirs = {f"llama{n}": build_model("llama", root / f"llama{n}", num_hidden_layers=n,
                                     max_position_embeddings=2048, **HEAD64) for n in (2, 8)}
    dirs["vlm"] = build_mmkv_vlm(root / "vlm", early_exit_layer=2, **HEAD64)
    return dirs


def engines(directory, **options) -> tuple[Engine, Engine]:
    """The same model on the torch backend and on FlashInfer (bfloat16, CUDA)."""
    kw = dict(device="cuda", dtype="bfloat16", kv_cache_memory="256MiB", host_kv_memory="16MiB",
              block_size=PAGE, debug=True, **options)
    plain = Engine(directory, attention_backend="torch", **kw)
    check_supported(CUDA, plain.model.dtype, plain.model.kv_layout(PAGE).head_dim)
    return plain, Engine(directory, attention_backend=CountingBackend(), **kw)


def agreement(a, b) -> float:
    return sum(x.token_ids == y.token_ids for x, y in zip(a, b)) / len(a)


@pytest.mark.parametrize("layers, exit_layer", [(2, 1), (8, 2)])
@pytest.mark.parametrize("speculate", [False, True])
def test_engine_greedy_tokens_on_flashinfer(gpu_dirs, layers, exit_layer, speculate):
    """A shared 200-token document (cold, then prefix hits; decode steps in cascade), unrelated
    prompts, chunked prefill; with speculation, early exit after ``exit_layer``."""
    directory = gpu_dirs[f"llama{layers}"]
    spec = SpeculativeConfig(num_tokens=6, early_exit_layer=exit_layer, settings=LEARNING) if speculate else None
    rng = random.Random(layers)
    doc = [rng.randrange(256) for _ in range(200)]
    first = [doc + [rng.randrange(256) for _ in range(n)] for n in (5, 9)] + [[7] * 40, [3, 1]]
    later = [doc + [rng.randrange(256) for _ in range(n)] for n in (4, 6, 8, 10, 12, 14)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    outs = {}
    for eng in engines(directory, speculative=spec, max_num_batched_tokens=256):
        outs[eng.attention.name] = eng.generate(first, params) + eng.generate(later, params)
        assert eng.stats()["cached_prompt_tokens"] >= 6 * 192 and eng.stats()["blocks_in_use"] == 0
        assert (eng.stats().get("spec_rounds", 0) > 0) == speculate
        if eng.attention.name == "flashinfer":
            assert eng.attention.calls["merge_state"] > 0  # cascade ran
    model = load_hf(directory).to(CUDA)
    for outputs in outs.values():
        for prompt, out in zip(first + later, outputs):
            assert_near_greedy(model, prompt, out.token_ids)
    print(f"llama{layers} speculate={speculate}: token agreement flashinfer/torch "
          f"{agreement(outs['flashinfer'], outs['torch']):.2f}")


@pytest.mark.parametrize("speculate", [False, True])
def test_engine_cross_attention_on_flashinfer(gpu_dirs, speculate):
    """Questions about two images (text before the image in some), plus a text-only request."""
    spec = SpeculativeConfig(num_tokens=4, settings=LEARNING) if speculate else None
    images = [picture(1), picture(2, size=(30, 50))]
    questions = [[IMAGE_TOKEN] + list(b"What is it?"), list(b"Hi ") + [IMAGE_TOKEN] + list(b"Colour?"),
                 [IMAGE_TOKEN] + list(b"How many are there?")]
    requests = [{"prompt": p, "images": [img]} for img in images for p in questions]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    outs = {}
    for eng in engines(gpu_dirs["vlm"], speculative=spec):
        outs[eng.attention.name] = eng.generate(requests + [list(b"text only")], params)[:-1]
        assert eng.stats()["encoder_calls"] == 2 and eng.stats()["blocks_in_use"] == 0
    model = MmkvVLM.from_pretrained(gpu_dirs["vlm"]).to(CUDA)
    for outputs in outs.values():
        for req, out in zip(requests, outputs):
            pixels = eng.model.vision.encoder.preprocess(req["images"][0])["pixel_values"].to(CUDA)
            logits = mmkv_vlm_logits(model, model.image_features(pixels), req["prompt"] + out.token_ids)
            assert_within_near_ties(logits[len(req["prompt"]) - 1:-1], out.token_ids)
    print(f"vlm speculate={speculate}: token agreement flashinfer/torch "
          f"{agreement(outs['flashinfer'], outs['torch']):.2f}")


def test_fp8_kv_cache_on_flashinfer(gpu_dirs):
    """``kv_cache_dtype="fp8_e4m3"``: FlashInfer's own fp8 KV (``kv_data_type`` fp8, scales 1)
    against the torch backend reading the same fp8 bytes; greedy tokens mostly agree (both
    compute from the same stored K/V, in different orders)."""
    rng = random.Random(5)
    doc = [rng.randrange(256) for _ in range(120)]
    prompts = [doc + [rng.randrange(256) for _ in range(n)] for n in (3, 7, 11)] + [[9] * 30]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    outs = {}
    for eng in engines(gpu_dirs["llama2"], kv_cache_dtype="fp8_e4m3"):
        assert eng.kv.storage.layers[0].dtype == torch.float8_e4m3fn
        outs[eng.attention.name] = eng.generate(prompts, params)
        assert eng.stats()["blocks_in_use"] == 0
    share = agreement(outs["flashinfer"], outs["torch"])
    print(f"fp8 KV: token agreement flashinfer/torch {share:.2f}")
    assert share >= 0.75
