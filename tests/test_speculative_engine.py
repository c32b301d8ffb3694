"""Speculative decoding in the engine: exact greedy output on every family, no trace of rejected
drafts in cached blocks, and no blocks of its own (sampling: test_sampling_distribution.py)."""

import sys
from pathlib import Path
from typing import Callable

import pytest
import torch

import mmkv.native
from mmkv import Engine, SamplingParams
from mmkv.models import MmkvVLM
from mmkv.sampler import top_tokens, top_tokens_kernel
from mmkv.sequence import Sequence
from speculative import PassCosts, SpeculativeConfig
from speculative.controller import Settings
from speculative.proposers import Speculator, _draft
from test_engine_oracle import BLOCK_BYTES, prompts
from tiny_models import FAMILIES, LEARNING, build_model, hf_greedy, load_hf
from tiny_vlms import IMAGE_TOKEN, picture

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def spec_engine(directory, blocks=1024, k=1, gamma=3, draft_length="auto", settings=LEARNING,
                threshold=None, **kw) -> Engine:
    kw.setdefault("debug", True)
    return Engine(directory, kv_cache_memory=blocks * BLOCK_BYTES, host_kv_memory=blocks * BLOCK_BYTES,
                  block_size=4, device="cpu",
                  speculative=SpeculativeConfig(num_tokens=gamma, early_exit_layer=k, draft_length=draft_length,
                                                settings=settings, adaptive_threshold=threshold), **kw)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("gamma, budget", [(3, 2048), (1, 2048), (6, 7)])  # 7: chunked prefill
def test_early_exit_greedy_equals_transformers(model_dirs, hf_oracle, family, gamma, budget):
    """Every text family (Mistral's sliding window of 24 is crossed by the 30-token prompt plus
    24 answer tokens; RoPE scaling), whole and chunked prefill, against transformers."""
    batch = prompts(40, [5, 17, 9, 30])
    eng = spec_engine(model_dirs[family], k=1, gamma=gamma, max_num_batched_tokens=budget)
    outs = eng.generate(batch, GREEDY)
    for p, o in zip(batch, outs):
        assert o.token_ids == hf_oracle(family, p, 24)
    stats = eng.stats()
    assert stats["spec_rounds"] > 0 and stats["blocks_in_use"] == 0
    assert stats["generated_tokens"] == sum(len(o.token_ids) for o in outs)


def test_early_exit_with_prefix_hits_preemption_and_adaptive_drafting(model_dirs, hf_oracle):
    [doc] = prompts(41, [21])
    batch = [doc + q for q in prompts(42, [3, 4, 5, 6, 7])]
    eng = Engine(model_dirs["qwen2"], kv_cache_memory=30 * BLOCK_BYTES, host_kv_memory=30 * BLOCK_BYTES,
                 block_size=4, device="cpu", debug=True,
                 speculative=SpeculativeConfig(num_tokens=4, early_exit_layer=1, adaptive_threshold=0.3,
                                               draft_length="fixed"))  # every round may draft 4
    outs = eng.generate(batch, GREEDY)
    for p, o in zip(batch, outs):
        assert o.token_ids == hf_oracle("qwen2", p, 24)
    stats = eng.stats()
    assert stats["cached_prompt_tokens"] > 0 and stats["spec_rounds"] > 0
    assert stats["preemptions_swap"] + stats["preemptions_recompute"] > 0
    assert stats["spec_drafted_tokens"] < 4 * stats["spec_rounds"]  # adaptive rounds stopped early
    assert stats["blocks_in_use"] == 0


def test_a_draft_pass_keeps_each_rows_token_and_confidence():
    """The greedy rows of a draft pass are drafted together: each keeps its own argmax and its
    distribution's top probability (what the confidence threshold reads); a sampled row draws from
    its own filtered distribution, which verification needs."""
    logits = torch.tensor([[4.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.1, 0.0], [0.0, 12.0, 0.0, 0.0],
                           [0.0, 0.0, 0.0, 3.0]])
    params = [SamplingParams(), SamplingParams(), SamplingParams(temperature=1.0, seed=3), SamplingParams()]
    seqs = [Sequence(seq_id=i, request_id=i, index=0, token_ids=[1], prompt_len=1, params=p, arrival=i,
                     namespace=b"", generator=torch.Generator().manual_seed(3))
            for i, p in enumerate(params)]
    drafted = _draft(seqs, logits, need_confidence=True)
    assert [token for token, _, _ in drafted] == [0, 2, 1, 3]
    for row in (0, 1, 3):
        assert drafted[row][1] is None
        assert drafted[row][2] == pytest.approx(torch.softmax(logits[row], -1).max().item())
    assert drafted[2][1].sum().item() == pytest.approx(1.0) and drafted[2][2] > 0.99
    assert all(confidence is None for _, _, confidence in _draft(seqs[:2], logits[:2], False))


@pytest.mark.parametrize("native", ["1", "0"])
def test_top_tokens_are_the_argmax_and_its_probability(native, monkeypatch):
    """``top_tokens`` (the native kernel, and torch's path with ``MMKV_NATIVE=0``) against torch's
    argmax and softmax's largest value: on wide random rows, on rows whose largest value repeats
    (the first wins, as torch's argmax), on a NaN row (NaN wins), on a row mostly -inf, on strided
    rows (a slice of a wider tensor, as the rows of a packed pass), and on one row."""
    monkeypatch.setenv("MMKV_NATIVE", native)
    mmkv.native.library.cache_clear()
    top_tokens_kernel.cache_clear()
    try:
        assert (top_tokens_kernel() is None) == (native == "0")
        gen = torch.Generator().manual_seed(0)
        wide = torch.randn(9, 2051, generator=gen) * 4
        wide[1, [7, 300, 2000]] = 50.0  # a repeated maximum
        wide[2, 5:] = 0.0
        wide[2, 1000] = float("nan")
        wide[4, :700] = float("-inf")  # masked out
        cases = [wide[:, :1024], wide[:, 1:2000], wide[3:4, :1024], wide[:, :2051]]
        for logits in cases:
            tokens, probs = top_tokens(logits, with_probs=True)
            assert tokens == logits.argmax(dim=-1).tolist()
            assert top_tokens(logits)[1] is None and top_tokens(logits)[0] == tokens
            want = torch.softmax(logits.double(), -1).max(dim=-1).values
            finite = ~torch.isnan(want)
            assert torch.allclose(torch.tensor(probs, dtype=torch.float64)[finite], want[finite], rtol=1e-5)
    finally:
        mmkv.native.library.cache_clear()
        top_tokens_kernel.cache_clear()


class ScriptedDraft(Speculator):
    """A draft and a target that both continue ``script`` (every draft is accepted)."""

    def __init__(self, script: list[int], vocab: int = 16) -> None:
        super().__init__(None, SpeculativeConfig(num_tokens=8), None)
        self.script, self.vocab, self.passes = script, vocab, 0

    def _next(self, position: int) -> torch.Tensor:
        return torch.nn.functional.one_hot(torch.tensor(self.script[position]), self.vocab).float()

    def _draft_pass(self, seqs, tokens, kv_lens, drafting, live):
        self.passes += 1
        return torch.stack([self._next(kv_lens[r]) for r in drafting]) if drafting else None

    def _verify_logits(self, seqs, gammas, drafts, lens):
        return torch.stack([self._next(n + j) for n, g in zip(lens, gammas) for j in range(g + 1)])


def test_drafting_stops_at_a_token_that_ends_the_sequence():
    script = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    seq = Sequence(seq_id=0, request_id=0, index=0, token_ids=script[:2], prompt_len=2,
                   params=SamplingParams(), arrival=0, namespace=b"", generator=None)
    spec = ScriptedDraft(script)
    [verdict] = spec.round([seq], [8], [{5}])  # drafts 3, 4; then 5 would end the sequence
    assert verdict.tokens == [3, 4, 5] and verdict.accepted == 2  # 5 is the target's own token
    assert spec.passes == 3  # no pass and no verified row for the token that ends it
    [verdict] = spec.round([seq], [8], [set()])
    assert verdict.accepted == 8 and spec.passes == 3 + 9


class SameDistribution(Speculator):
    """A draft and a target whose next token is drawn from ``probs`` at every position."""

    def __init__(self, probs: list[float]) -> None:
        super().__init__(None, SpeculativeConfig(num_tokens=8), None)
        self.logits = torch.tensor(probs).log()

    def _draft_pass(self, seqs, tokens, kv_lens, drafting, live):
        return self.logits.expand(len(drafting), -1) if drafting else None

    def _verify_logits(self, seqs, gammas, drafts, lens):
        return self.logits.expand(sum(g + 1 for g in gammas), -1)


def test_a_sampled_draft_of_a_token_that_ends_the_sequence_is_verified_as_drawn():
    """Sampled, a drafted end is verified like any draft: dropping it (as greedy rounds may, where
    the target's own token decides) would end the sequence with half the target's chance here."""
    generator = torch.Generator().manual_seed(0)
    seq = Sequence(seq_id=0, request_id=0, index=0, token_ids=[1, 1], prompt_len=2,
                   params=SamplingParams(temperature=1.0), arrival=0, namespace=b"", generator=generator)
    spec, trials = SameDistribution([0.5, 0.5]), 2000
    ended = sum(spec.round([seq], [1], [{0}])[0].tokens[0] == 0 for _ in range(trials))
    assert abs(ended / trials - 0.5) < 0.05  # the target's chance of ending (0.25 if dropped)


@pytest.mark.parametrize("kwargs, message", [
    ({"method": "medusa"}, "method"), ({"num_tokens": 0}, "num_tokens"),
    ({"adaptive_threshold": 1.5}, "adaptive_threshold"),
    ({"method": "draft_model"}, "draft_model"), ({"settings": {"calibrate": 0}}, "settings")])
def test_bad_speculative_settings_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig(**kwargs)


@pytest.mark.parametrize("threshold", [None, 0.999])
def test_early_exit_on_a_cross_attention_vlm_uses_the_shared_image_kv(vlm_dirs, threshold):
    """With a confidence threshold of 0.999 most rounds draft nothing, and their verification
    runs on draft pass 0's plan, cross-attention included."""
    requests = [{"prompt": [IMAGE_TOKEN] + list(b"question %d?" % i), "images": [picture(i % 2)]}
                for i in range(6)] + [list(b"text only")]
    plain = Engine(vlm_dirs["mmkv_vlm"], kv_cache_memory=2048 * BLOCK_BYTES,
                   host_kv_memory=1 << 20, block_size=4, device="cpu")
    want = [o.token_ids for o in plain.generate(requests, GREEDY)]
    eng = spec_engine(vlm_dirs["mmkv_vlm"], blocks=2048, k=3, gamma=4,  # cross layer 1 drafts too
                      draft_length="fixed" if threshold else "auto", threshold=threshold)
    assert [o.token_ids for o in eng.generate(requests, GREEDY)] == want
    stats = eng.stats()
    if threshold:
        assert stats["spec_drafted_tokens"] < stats["spec_rounds"] / 2
    assert stats["encoder_calls"] == 2 and stats["xattn_blocks_computed"] == plain.stats()["xattn_blocks_computed"]
    assert eng.kv.layout == plain.kv.layout  # the draft keeps no K/V of its own


@pytest.mark.parametrize("k", [1, 2])  # layers 0 and 2 of 4 run for text; 1 and 3 are cross layers
def test_training_script_trains_the_exit_the_engine_drafts_from(vlm_dirs, k):
    """examples/train_tiny.py takes the early-exit state from transformers' recorded hidden states;
    text without an image skips the cross-attention layers there, so its index must count only
    the layers that ran (an index of k once trained documents' exit one layer too deep)."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))
    from train_tiny import after_layers

    eng = spec_engine(vlm_dirs["mmkv_vlm"], blocks=2048, k=k, gamma=3, draft_length="fixed")
    spec, drafted = eng.speculator, []
    draft_pass = spec._draft_pass

    def recording(seqs, tokens, kv_lens, drafting, live):
        logits = draft_pass(seqs, tokens, kv_lens, drafting, live)
        drafted.append((kv_lens[0] - 1, tokens[0], spec.hidden[live[0]][-1].clone()))
        return logits

    spec._draft_pass = recording
    prompt = list(b"text only, no image")
    ids = prompt + eng.generate([prompt], GREEDY)[0].token_ids
    model = MmkvVLM.from_pretrained(vlm_dirs["mmkv_vlm"]).eval()
    with torch.no_grad():
        states = model.language_model.model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    want = after_layers(model, states, k, with_image=False)[0]
    checked = [(pos, h) for pos, token, h in drafted if ids[pos] == token]
    assert len(checked) >= 10
    for pos, h in checked:
        torch.testing.assert_close(h, want[pos], atol=1e-4, rtol=1e-4)


def draft_engine(target, draft, blocks=1024, gamma=3, draft_length="auto", settings=LEARNING,
                 **kw) -> Engine:
    kw.setdefault("debug", True)
    per_block = 2 * BLOCK_BYTES  # target and draft stores of the same blocks
    return Engine(target, kv_cache_memory=blocks * per_block, host_kv_memory=blocks * per_block,
                  block_size=4, device="cpu",
                  speculative=SpeculativeConfig(method="draft_model", num_tokens=gamma, draft_model=draft,
                                                draft_length=draft_length, settings=settings),
                  **kw)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_draft_model_greedy_equals_transformers(model_dirs, hf_oracle, tmp_path, family):
    draft = build_model("llama", tmp_path / "draft", seed=3, num_hidden_layers=1)
    batch = prompts(43, [6, 13, 22])
    eng = draft_engine(model_dirs[family], draft, max_num_batched_tokens=9)
    outs = eng.generate(batch, GREEDY)
    for p, o in zip(batch, outs):
        assert o.token_ids == hf_oracle(family, p, 24)
    assert eng.stats()["spec_rounds"] > 0 and eng.kv.storage.layouts[1].num_layers == 1


@pytest.mark.parametrize("method", ["early_exit", "draft_model"])
def test_calibration_leaves_nothing_behind_but_the_pass_costs(model_dirs, tmp_path, method):
    """An engine that speculates times its passes when it starts, decoding made-up requests at
    batch sizes 1 and 8 (32 would take more than half of this pool), then forgets them: its
    stats, request ids and blocks are those of an engine that did not, before and after both
    serve the same requests with the same output, and its controller has timed plain, draft and
    verification passes (and the draft model's catch-up)."""
    draft = build_model("llama", tmp_path / "draft", seed=3, num_hidden_layers=1)

    def engine(calibrate: int) -> Engine:
        settings = Settings(calibrate=calibrate)
        if method == "early_exit":
            return spec_engine(model_dirs["llama"], settings=settings, max_num_seqs=8)
        return draft_engine(model_dirs["llama"], draft, settings=settings, max_num_seqs=8)

    def traces(eng: Engine) -> dict:  # what the requests leave, not how long or how they decoded
        return {name: value for name, value in eng.stats().items()
                if not name.startswith(("spec_", "step_seconds", "decode_threads"))}

    calibrated, fresh = engine(1), engine(0)
    kinds = ("plain", "verify", "first_draft", "draft") + (("catch_up",) if method == "draft_model" else ())
    assert all(calibrated.speculator.controller.costs.counts[kind] for kind in kinds)
    assert not any(fresh.speculator.controller.costs.counts[kind] for kind in kinds)
    assert traces(calibrated) == traces(fresh)
    assert calibrated.speculator.summary() == fresh.speculator.summary()  # nothing counted
    if calibrated.runner.decode_threads is not None:  # the requests' batches choose the thread count
        assert vars(calibrated.runner.decode_threads) == vars(fresh.runner.decode_threads)
    batch = prompts(49, [6, 13, 22])
    outs = [eng.generate(batch, GREEDY) for eng in (calibrated, fresh)]
    assert [o.request_id for o in outs[0]] == [o.request_id for o in outs[1]] == [0, 1, 2]
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]
    served = [{k: v for k, v in traces(eng).items() if not k.startswith("peak_")}  # the rounds each
              for eng in (calibrated, fresh)]  # chose reserved their own slots at the peak
    assert served[0] == served[1]


@pytest.mark.parametrize("method", ["draft_model", "early_exit"])
def test_cached_generated_blocks_hold_no_rejected_kv(model_dirs, hf_oracle, tmp_path, method):
    """A draft that is mostly wrong leaves a rejected token's K/V after almost every round. A
    second request whose prompt is the first prompt, its answer and a question is served from the
    blocks the first one generated: prompt plus answer fill whole blocks, so the last of them ends
    with the answer's last token, whose slot only ever held what a verification pass wrote there.
    Any slot the engine counted as computed while it held a rejected draft's K/V changes the
    second answer. Draft lengths are fixed: the controller would stop drafting with such a draft."""
    if method == "draft_model":
        wrong = build_model("llama", tmp_path / "wrong", seed=7, num_hidden_layers=1)
        eng = draft_engine(model_dirs["llama"], wrong, draft_length="fixed")
    else:
        eng = spec_engine(model_dirs["llama"], k=1, gamma=3, draft_length="fixed")
    for seed, length in ((46, 8), (47, 12), (48, 16)):  # length + 24 answer tokens: whole blocks
        [prompt, question] = prompts(seed, [length, 5])
        first = eng.generate([prompt], GREEDY)[0]
        assert first.token_ids == hf_oracle("llama", prompt, 24)
        follow = prompt + first.token_ids + question
        second = eng.generate([follow], GREEDY)[0]
        assert second.cached_tokens >= length + 24 - eng.kv.block_size
        assert second.token_ids == hf_oracle("llama", follow, 24)
    assert eng.stats()["spec_acceptance_rate"] < (0.1 if method == "draft_model" else 0.6)
    assert eng.stats()["blocks_in_use"] == 0


@pytest.mark.parametrize("prefill_draft", [True, False])
@pytest.mark.parametrize("preemption", ["swap", "recompute"])
def test_draft_store_follows_prefix_hits_and_preemption(model_dirs, hf_oracle, preemption,
                                                        prefill_draft, monkeypatch):
    """With the target as its own draft every draft must be accepted: any stale or missing draft
    K/V (after a prefix hit, a swap or a recompute) would show up as a rejection; with the draft
    following prompts and with it leaving them to catch-up passes."""
    [doc] = prompts(44, [17])
    batch = [doc + q for q in prompts(45, [3, 5, 4, 6, 2])]
    eng = draft_engine(model_dirs["llama"], model_dirs["llama"], blocks=30, preemption=preemption)
    monkeypatch.setattr(type(eng.speculator.controller), "drafting_lately", lambda self: prefill_draft)
    outs = eng.generate(batch, GREEDY)
    for p, o in zip(batch, outs):
        assert o.token_ids == hf_oracle("llama", p, 24)
    stats = eng.stats()
    assert stats["cached_prompt_tokens"] > 0 and stats[f"preemptions_{preemption}"] > 0
    assert stats["spec_acceptance_rate"] == 1.0 and stats["blocks_in_use"] == 0


def test_draft_model_must_share_the_vocabulary(model_dirs, vlm_dirs):
    with pytest.raises(ValueError, match="vocabulary"):
        draft_engine(model_dirs["llama"], vlm_dirs["llava"])


class FrozenCosts(PassCosts):
    """The controller's cost model fitted to scripted passes (seconds as a function of rows, for
    1 to 256 rows: ``draft`` and ``verify``, which plain decoding shares) and then frozen, so that
    its choices depend on acceptance alone and a test runs the same however loaded the machine
    is."""

    SHARED = {"draft": ("first_draft", "draft"), "verify": ("plain", "verify")}

    def __init__(self, **script: Callable[[int], float]) -> None:
        super().__init__()
        for name, seconds in script.items():
            for kind in self.SHARED[name]:
                for rows in (1, 4, 16, 64, 256):
                    super().observe(kind, rows, 16 * rows, seconds(rows))

    def observe(self, kind: str, rows: int, context: int, seconds: float,
                sequences: int | None = None) -> None:
        """Measured passes teach it nothing."""


def test_a_block_the_tree_held_already_is_drafted_from_what_it_holds(model_dirs, hf_oracle, monkeypatch):
    """Two requests for the same prompt, the second joining while the first decodes plainly: each
    block the second fills is one the first filled and cached already, so caching it points the
    second's table at the first's block, whose draft store never ran (the first never drafted).
    The second, its own draft (the target), must then catch its draft up over that block rather
    than read it as its own copy held it: every draft it proposes is accepted."""
    eng = draft_engine(model_dirs["llama"], model_dirs["llama"])
    controller = eng.speculator.controller
    first = []

    def decide(histories, limits, state, beside_prompts=False):  # the first request never drafts
        first.extend(histories[:1] if not first else [])
        for h in histories:
            h.decisions += 1
        return [0 if h is first[0] else limit for h, limit in zip(histories, limits())]

    monkeypatch.setattr(controller, "decide", decide)
    [prompt] = prompts(49, [10])
    outputs = {}
    eng.add_request(prompt, GREEDY)
    for _ in range(6):
        outputs.update((o.request_id, o) for o in eng.step() if o.finished)
    eng.add_request(prompt, GREEDY)
    while eng.has_unfinished():
        outputs.update((o.request_id, o) for o in eng.step() if o.finished)
    assert [o.token_ids for o in outputs.values()] == [hf_oracle("llama", prompt, 24)] * 2
    stats = eng.stats()
    assert stats["spec_drafted_tokens"] > 0 and stats["spec_acceptance_rate"] == 1.0


def freeze_costs(eng: Engine, **script: Callable[[int], float]) -> None:
    """Give the engine's controller ``FrozenCosts(**script)`` and keep its decoding steps on one
    thread count (a switch would have the controller learn its pass costs afresh)."""
    eng.speculator.controller.costs = FrozenCosts(**script)
    eng.runner.decode_threads = None


@pytest.fixture(scope="module")
def damped_pair(model_dirs, tmp_path_factory):
    """The tiny Llama with its second layer's output projections scaled by 0.3, so that its first
    layer (early exit after layer 1, or the same layer saved as a draft model) is right about a
    third of the time; the draft; and transformers' greedy continuation, memoised."""
    root = tmp_path_factory.mktemp("damped")
    model = load_hf(model_dirs["llama"])
    with torch.no_grad():
        model.model.layers[1].self_attn.o_proj.weight.mul_(0.3)
        model.model.layers[1].mlp.down_proj.weight.mul_(0.3)
    model.save_pretrained(root / "target")
    memo: dict[tuple[int, ...], list[int]] = {}

    def oracle(prompt: list[int]) -> list[int]:
        if tuple(prompt) not in memo:
            memo[tuple(prompt)] = hf_greedy(model, prompt, 24)
        return memo[tuple(prompt)]

    draft = load_hf(root / "target")
    draft.model.layers = draft.model.layers[:1]
    draft.config.num_hidden_layers = 1
    draft.save_pretrained(root / "draft")
    return root / "target", root / "draft", oracle


@pytest.mark.parametrize("method", ["early_exit", "draft_model"])
@pytest.mark.parametrize("batch", [1, 8, 32])
def test_controlled_draft_lengths_keep_greedy_output_at_every_batch_size(damped_pair, method, batch):
    """With the controller choosing every step's draft length (0 included), output equals
    transformers' and plain decoding's. Batch 1 serves three requests one at a time."""
    target, draft, oracle = damped_pair
    batch_prompts = prompts(60 + batch, [4 + (7 * i) % 23 for i in range(max(batch, 3))])
    priced = Settings(calibrate=0, explore=0)  # every choice priced from acceptance alone
    if method == "early_exit":
        eng = spec_engine(target, k=1, gamma=6, max_num_seqs=batch, settings=priced)
    else:
        eng = draft_engine(target, draft, gamma=6, max_num_seqs=batch, settings=priced)
    freeze_costs(eng, draft=lambda r: 0.1 + 0.01 * r, verify=lambda r: 1 + 0.02 * r)
    outs = eng.generate(batch_prompts, GREEDY)
    plain = Engine(target, kv_cache_memory=1024 * BLOCK_BYTES, host_kv_memory=1 << 20,
                   block_size=4, device="cpu", max_num_seqs=batch).generate(batch_prompts, GREEDY)
    for p, o, q in zip(batch_prompts, outs, plain):
        assert o.token_ids == q.token_ids == oracle(p)
    stats = eng.stats()
    assert stats["spec_drafted_tokens"] > 0 and stats["spec_zero_drafts"] > 0
    assert 0 < stats["spec_acceptance_rate"] < 1 and stats["blocks_in_use"] == 0


def test_a_draft_model_left_behind_by_plain_steps_catches_up(model_dirs, hf_oracle):
    """Costs frozen so that plain decoding wins at batch 4 and speculation below (a target pass
    costs 1 whatever its rows, a draft pass 0.2 + 0.14 a row: with every draft accepted, a round of
    3 drafts gives 4 tokens a sequence for 4 draft passes and 1, against 4 plain passes): the draft
    model skips the plain steps and must catch up when the batch shrinks. With the target as its own draft, any
    position of the draft's K/V not caught up shows as a rejection."""
    batch = prompts(70, [6, 9, 12, 15])
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (8, 10, 80, 100)]
    eng = draft_engine(model_dirs["llama"], model_dirs["llama"], gamma=3)
    freeze_costs(eng, draft=lambda r: 0.2 + 0.14 * r, verify=lambda r: 1.0)
    outs = eng.generate(batch, params)
    for p, o, n in zip(batch, outs, (8, 10, 80, 100)):
        assert o.token_ids == hf_oracle("llama", p, n)
    stats = eng.stats()
    assert stats["spec_plain_steps"] >= 7 and stats["spec_drafted_tokens"] >= 10
    assert stats["spec_acceptance_rate"] == 1.0 and stats["blocks_in_use"] == 0


def test_a_draft_model_speculates_again_after_plain_steps_between_rounds(model_dirs, hf_oracle):
    """Round, then plain steps, then rounds again for the same sequences: two requests speculate
    alone, two more arrive (batch 4: plain decoding, the draft falls behind from where its last
    round left it) and finish, and the first two speculate again. With the target as its own
    draft, a watermark off by one after a round shows as a rejection."""
    first, later = prompts(71, [7, 10]), prompts(72, [5, 6])
    eng = draft_engine(model_dirs["llama"], model_dirs["llama"], gamma=3)
    freeze_costs(eng, draft=lambda r: 0.2 + 0.14 * r, verify=lambda r: 1.0)
    long, short = SamplingParams(max_tokens=40, ignore_eos=True), SamplingParams(max_tokens=6, ignore_eos=True)
    ids = [eng.add_request(p, long) for p in first]
    outputs = {}
    for _ in range(3):  # prefill, then rounds for the first two alone
        outputs.update((o.request_id, o) for o in eng.step())
    rounds_before = eng.stats()["spec_rounds"]
    assert rounds_before > 0
    ids += [eng.add_request(p, short) for p in later]
    while eng.has_unfinished():
        outputs.update((o.request_id, o) for o in eng.step())
    stats = eng.stats()
    assert stats["spec_plain_steps"] >= 3 and stats["spec_rounds"] > rounds_before + 2
    for rid, p, n in zip(ids, first + later, (40, 40, 6, 6)):
        assert outputs[rid].outputs[0].token_ids == hf_oracle("llama", p, n)
    assert stats["spec_acceptance_rate"] == 1.0 and stats["blocks_in_use"] == 0


def test_a_draft_model_skipped_at_prefill_is_filled_in_not_trusted(model_dirs, hf_oracle, monkeypatch):
    """While the controller runs no rounds the draft model skips prompts; the blocks those prompts
    leave in the cache hold no draft K/V, and a later request that hits them, prefilled while the
    draft follows prompts, has the draft caught up over them through its new tokens (one pass)
    instead of drafting from whatever the draft store holds there. A prompt the draft did follow
    serves a later hit as far as its blocks reach. With the target as its own draft, any position
    read without current draft K/V shows as a rejection."""
    eng = draft_engine(model_dirs["llama"], model_dirs["llama"], gamma=3)
    freeze_costs(eng, draft=lambda r: 0.01, verify=lambda r: 1.0)  # rounds always pay
    [doc, other] = prompts(80, [21, 18])
    one_token = SamplingParams(max_tokens=1, ignore_eos=True)
    follow = [False]
    monkeypatch.setattr(type(eng.speculator.controller), "drafting_lately", lambda self: follow[0])
    eng.generate([doc + [5]], one_token)  # prefilled without the draft, no round
    follow[0] = True
    eng.generate([other + [6]], one_token)  # prefilled with the draft
    bs = eng.kv.block_size
    caught_up = []
    original = type(eng.speculator)._catch_up

    def catch_up(self, seqs, ends=None):
        caught_up.extend(e - self._watermark(s)
                         for s, e in zip(seqs, ends or [len(s.token_ids) - 1 for s in seqs]))
        return original(self, seqs, ends)

    monkeypatch.setattr(type(eng.speculator), "_catch_up", catch_up)
    batch = [doc + [7, 8], other + [9, 10]]
    outs = eng.generate(batch, SamplingParams(max_tokens=12, ignore_eos=True))
    for p, o in zip(batch, outs):
        assert o.token_ids == hf_oracle("llama", p, 12)
    assert outs[0].cached_tokens >= len(doc) // bs * bs and outs[1].cached_tokens >= len(other) // bs * bs
    # at prefill: the skipped document is caught up from position 0 through its new tokens, the
    # followed one from where its cached blocks end; the first round then catches up nothing
    assert caught_up[:2] == [len(doc) + 2, len(other) + 2 - outs[1].cached_tokens]
    assert caught_up[2:4] == [0, 0]
    stats = eng.stats()
    assert stats["spec_drafted_tokens"] > 0 and stats["spec_acceptance_rate"] == 1.0


def test_a_draft_model_runs_only_for_the_sequences_that_draft(model_dirs, hf_oracle, monkeypatch):
    """Rounds where one sequence drafts and the other drafts 0, alternating: the draft model reads
    only the drafting sequence's positions (the other joins verification alone, falls behind and
    is caught up when its turn comes). With the target as its own draft any position the draft
    skipped but counted as current shows as a rejection."""
    eng = draft_engine(model_dirs["llama"], model_dirs["llama"], gamma=3)
    turns = iter(range(1000))

    def decide(histories, limits, state, beside_prompts=False):  # two steps for one, two for the other
        turn = next(turns) // 2 % 2
        return [min(2, limit) if i % 2 == turn else 0 for i, limit in enumerate(limits())]

    monkeypatch.setattr(eng.speculator.controller, "decide", decide)
    rows = []
    original = type(eng.speculator)._draft_pass

    def draft_pass(self, seqs, *rest):
        rows.append(len(seqs))
        return original(self, seqs, *rest)

    monkeypatch.setattr(type(eng.speculator), "_draft_pass", draft_pass)
    batch = prompts(81, [9, 14])
    outs = eng.generate(batch, SamplingParams(max_tokens=16, ignore_eos=True))
    for p, o in zip(batch, outs):
        assert o.token_ids == hf_oracle("llama", p, 16)
    stats = eng.stats()
    assert rows and max(rows) == 1 and stats["spec_drafted_tokens"] >= 8
    assert stats["spec_acceptance_rate"] == 1.0


def test_a_draft_model_tells_the_controller_how_far_behind_each_sequence_is(model_dirs, monkeypatch):
    """A prompt prefilled without the draft: the controller's first choice sees the whole prompt
    still to fill in, the tokens left to generate at most and the tokens generated, the catch-up
    pass is timed for it like any draft pass, and once a round has caught the draft up, nothing
    is behind. The length of an output that ended on a stop token is recorded for the
    controller's estimate of where running sequences end; one cut short at its limit is not."""
    eng = draft_engine(model_dirs["llama"], model_dirs["llama"], gamma=3)
    controller = eng.speculator.controller
    monkeypatch.setattr(type(controller), "drafting_lately", lambda self: False)
    seen = []
    original = type(controller).decide

    def decide(self, histories, limits, state, beside_prompts=False):  # what each state read sees
        def seen_state():
            lengths, progress, behind = state()
            seen.append(list(zip(behind, progress)))
            return lengths, progress, behind
        return original(self, histories, limits, seen_state, beside_prompts)

    monkeypatch.setattr(type(controller), "decide", decide)
    passes = []
    observe = controller.observe_pass
    monkeypatch.setattr(controller, "observe_pass", lambda kind, rows, *rest: (passes.append((kind, rows)),
                                                                               observe(kind, rows, *rest)))
    [prompt] = prompts(82, [13])
    [out] = eng.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))
    assert seen[0] == [(len(prompt), (1, 7))]
    # the first step decodes plainly (timing a plain pass first); the catch-up is timed over its
    # rows, that step's token too, as its own kind
    assert ("catch_up", len(prompt) + 1) in passes
    assert any(kind == "verify" for kind, _ in passes)  # timed once the engine applied the verdicts
    assert eng.stats()["spec_rounds"] > 0 and any(b[0][0] == 0 for b in seen[1:])
    assert not controller.lengths.recent  # cut short at its limit: not where an output ends
    eng.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True, stop_token_ids=[out.token_ids[2]]))
    assert list(controller.lengths.recent) == [out.token_ids.index(out.token_ids[2]) + 1]


@pytest.mark.parametrize("method", ["early_exit", "draft_model"])
def test_a_steps_scheduling_is_timed_with_its_target_pass(model_dirs, tmp_path, monkeypatch, method):
    """Scheduling a step (a round's slot reservations, the controller's own pricing) is part of
    what the step costs: on a clock that only scheduling moves (a second a step), every plain
    step's timing and every round's verification show that second (plain and verification
    passes share one cost fit, so a round pays for its scheduling once), and no other pass does."""
    if method == "early_exit":
        eng = spec_engine(model_dirs["llama"])
    else:
        eng = draft_engine(model_dirs["llama"], build_model("llama", tmp_path / "draft", seed=3,
                                                            num_hidden_layers=1))
    now = [0.0]
    controller, passes = eng.speculator.controller, []
    controller.clock = lambda: now[0]
    schedule = type(eng.scheduler).schedule
    monkeypatch.setattr(type(eng.scheduler), "schedule",
                        lambda self: (now.__setitem__(0, now[0] + 1.0), schedule(self))[1])
    observe = controller.observe_pass
    monkeypatch.setattr(controller, "observe_pass", lambda kind, rows, context, seconds, sequences=None: (
        passes.append((kind, seconds)), observe(kind, rows, context, seconds, sequences)))
    eng.generate(prompts(83, [9, 14]), SamplingParams(max_tokens=12, ignore_eos=True))
    assert {"plain", "first_draft", "draft", "verify"} <= {kind for kind, _ in passes}, passes
    assert all(s == 1.0 for kind, s in passes if kind in ("plain", "verify")), passes
    assert all(s == 0.0 for kind, s in passes if kind not in ("plain", "verify")), passes
