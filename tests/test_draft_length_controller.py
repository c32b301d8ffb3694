"""The draft-length controller on scripted drafts with scripted costs: it drafts 0 for a draft that
is always wrong, every sequence's limit for one that is always right, and stops speculating when a
large batch makes verification cost more than it saves, coming back when the batch shrinks. The scripted passes move a virtual clock, so every choice is reproducible."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mmkv import SamplingParams
from mmkv.bench.spec_compare import parse_settings
from mmkv.models import packed_linear
from mmkv.sequence import Sequence
from speculative import DraftLengthController, SpeculativeConfig
from speculative import costs as cost_model
from speculative.controller import EXPLORE, HOLD_MAX, Settings
from speculative.acceptance import regime
from speculative.costs import LinearFit, PassCosts
from speculative.lengths import OutputLengths
from speculative.proposers import Speculator

VOCAB = 16
LIMIT = 8


def target(position: int) -> int:
    """The target's token at ``position`` of every sequence."""
    return (position * 5 + 3) % VOCAB


class VirtualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ScriptedPair(Speculator):
    """A target that writes ``target(position)`` and a draft that agrees with it where
    ``right(seq_id, position)``; each pass moves the clock by its scripted cost (rows -> ms)."""

    def __init__(self, right, draft_cost, verify_cost) -> None:
        self.clock = VirtualClock()
        super().__init__(None, SpeculativeConfig(num_tokens=LIMIT), None, clock=self.clock)
        self.right, self.draft_cost, self.verify_cost = right, draft_cost, verify_cost

    def _one_hot(self, token: int) -> torch.Tensor:
        return torch.nn.functional.one_hot(torch.tensor(token), VOCAB).float()

    def _draft_pass(self, seqs, tokens, kv_lens, drafting, live):
        self.clock.now += self.draft_cost(len(seqs))
        rows = [self._one_hot((target(kv_lens[r]) + (0 if self.right(seqs[r].seq_id, kv_lens[r]) else 1)) % VOCAB)
                for r in drafting]
        return torch.stack(rows) if rows else None

    def _verify_logits(self, seqs, gammas, drafts, lens):
        self.clock.now += self.verify_cost(sum(g + 1 for g in gammas))
        return torch.stack([self._one_hot(target(n + j)) for n, g in zip(lens, gammas)
                            for j in range(g + 1)])


def sequences(n: int) -> list[Sequence]:
    return [Sequence(seq_id=i, request_id=i, index=0, token_ids=[target(0), target(1)], prompt_len=2,
                     params=SamplingParams(max_tokens=10_000), arrival=i, namespace=b"", generator=None)
            for i in range(n)]


def decode(spec: ScriptedPair, seqs: list[Sequence], steps: int, plain_cost) -> list[list[int]]:
    """Run ``steps`` engine-like steps: the controller's lengths, then a round or a plain step.
    Returns the lengths chosen at each step."""
    chosen = []
    for _ in range(steps):
        gammas = spec.plan(seqs, max_model_len=1 << 30)  # each may draft LIMIT (its num_tokens)
        chosen.append(gammas)
        if any(gammas):
            for seq, verdict in zip(seqs, spec.round(seqs, gammas, [set()] * len(seqs))):
                seq.token_ids += verdict.tokens
            spec.round_applied()
        else:
            start = spec.started()
            spec.clock.now += plain_cost(len(seqs))
            spec.observe("plain", len(seqs), sum(len(s.token_ids) for s in seqs), start)
            for seq in seqs:
                seq.token_ids.append(target(len(seq.token_ids)))
    for seq in seqs:  # the scripted rounds are exact: every token is the target's
        assert seq.token_ids == [target(p) for p in range(len(seq.token_ids))]
    return chosen


def draft_ms(rows: int) -> float:
    return 1.0 + 0.05 * rows


def verify_ms(rows: int) -> float:
    return 5.0 + 0.05 * rows


def plain_ms(rows: int) -> float:
    return 5.5 + 0.05 * rows


def test_an_always_wrong_draft_drafts_nothing():
    spec = ScriptedPair(lambda seq, pos: False, draft_ms, verify_ms)
    chosen = decode(spec, sequences(1), 30, plain_ms)
    assert all(g == [0] for g in chosen[2 * EXPLORE:]), chosen
    summary = spec.summary()
    assert summary["spec_zero_drafts"] >= 26 and summary["spec_plain_steps"] >= 26
    assert summary["spec_accepted_tokens"] == 0


def test_an_always_right_draft_drafts_its_limit():
    spec = ScriptedPair(lambda seq, pos: True, draft_ms, verify_ms)
    chosen = decode(spec, sequences(1), 30, plain_ms)
    assert all(g == [LIMIT] for g in chosen[2 * EXPLORE:]), chosen  # after timing both paths
    summary = spec.summary()
    assert summary["spec_acceptance_rate"] == 1.0
    assert summary["spec_seq_mean_draft_length_max"] > 0.8 * LIMIT


def test_a_plain_pass_is_timed_first():
    """Verification passes alone cannot tell their extra fixed cost from the intercept they share
    with plain decoding: a fresh controller decodes its first step plainly, then explores, then
    prices."""
    spec = ScriptedPair(lambda seq, pos: True, draft_ms, verify_ms)
    chosen = decode(spec, sequences(1), EXPLORE + 2, plain_ms)
    assert chosen == [[0]] + [[LIMIT]] * (EXPLORE + 1), chosen
    assert spec.controller.costs.counts["plain"] == 1 and spec.controller.planned == 1
    theta = spec.controller.costs.fit("plain").theta  # plain at 5.5 ms + 0.05 a row, verify at 5.0
    assert spec.controller.costs.predict("plain", 1, 3) == pytest.approx(plain_ms(1), rel=0.05), theta


def test_settings_replace_the_controllers_constants():
    """A controller on ``Settings(explore=1)`` prices after one plain step and one exploring
    round, not after ``EXPLORE`` rounds; ``parse_settings`` (``bench spec-compare --set``) names what it cannot take."""
    spec = ScriptedPair(lambda seq, pos: True, draft_ms, verify_ms)
    spec.controller.settings = Settings(explore=1)
    chosen = decode(spec, sequences(1), 3, plain_ms)
    assert chosen == [[0], [LIMIT], [LIMIT]] and spec.controller.planned == 1, chosen
    assert parse_settings(["explore=1", "round_margin=1.25"]) == Settings(explore=1, round_margin=1.25)
    for bad, named in ((["explores=1"], "explores=1"), (["explore=1.5"], "explore takes an integer"),
                       (["round_margin"], "round_margin")):
        with pytest.raises(ValueError, match=named):
            parse_settings(bad)


def test_a_step_drafts_one_length_for_every_sequence():
    """Sequences 0 and 1 have a draft that is always right, 2 and 3 one that is always wrong: a
    round's length is a step's decision, not a sequence's (each stops where its draft is unsure,
    or is rejected), so every priced step gives every sequence the same length, and here rounds
    pay."""
    spec = ScriptedPair(lambda seq, pos: seq < 2, draft_ms, verify_ms)
    chosen = decode(spec, sequences(4), 30, plain_ms)
    assert all(len(set(g)) == 1 for g in chosen), chosen
    assert sum(g[0] > 0 for g in chosen[EXPLORE + 1:]) >= 20, chosen


def test_a_large_batch_decodes_plainly_and_speculation_returns_when_it_shrinks():
    """Rows are expensive (0.5 ms each in verification and plain decoding): at batch 32 a round's
    extra verification rows cost more than its accepted drafts save; at batch 1 the pass's fixed
    5 ms dominates and drafting (0.55 ms a pass) pays. The draft is right seven positions in eight."""
    spec = ScriptedPair(lambda seq, pos: pos % 8 != 0, lambda rows: 0.5 + 0.05 * rows,
                        lambda rows: 5.0 + 0.5 * rows)
    seqs = sequences(32)
    chosen = decode(spec, seqs, 25, lambda rows: 5.0 + 0.5 * rows)
    assert all(not any(g) for g in chosen[10:]), chosen
    chosen = decode(spec, seqs[:1], 20, lambda rows: 5.0 + 0.5 * rows)
    assert all(g[0] > 0 for g in chosen[6:]), chosen


def test_with_its_pass_costs_known_it_explores_only_where_a_sure_draft_would_pay():
    """A draft pass costs 0.5 ms a sequence: at batch 32 its passes alone cost more than a plain
    step (5 + 0.5 ms a sequence), so not even a draft that is always right pays; at batch 1 it
    does. With its pass costs timed first, as the engine calibrates (scripted lengths at batches
    1 and 32, then all but the costs forgotten), the controller decodes a fresh batch of 32
    plainly from its first step, exploring nothing, and explores a lone sequence at once, then
    prices its next round."""
    spec = ScriptedPair(lambda seq, pos: True, lambda rows: 0.5 * rows, lambda rows: 5.0 + 0.5 * rows)
    plain = lambda rows: 5.0 + 0.5 * rows  # noqa: E731
    for batch in (1, 32):
        spec.controller.follow_script([0, 1, 0, 3])
        assert decode(spec, sequences(batch), 4, plain) == [[0] * batch, [1] * batch, [0] * batch, [3] * batch]
    spec.keep_costs_only()
    assert spec.controller.costs.counts["verify"] == 4 and spec.summary()["spec_rounds"] == 0
    chosen = decode(spec, sequences(32), 12, plain)
    assert not any(any(g) for g in chosen) and spec.summary()["spec_rounds"] == 0, chosen
    assert spec.controller.planned == 4  # priced at steps 1, 3, 6 and 11: held for doubling spans
    spec.controller.settings = Settings(explore=1)  # an exploring round is not held as a priced one
    assert decode(spec, sequences(1), 2, plain) == [[LIMIT], [LIMIT]]


def calibrated(draft_seconds: float) -> DraftLengthController:
    """A controller that has timed its passes but seen no round: one draft pass takes
    ``draft_seconds``, a verification of 2 rows and a plain step 5 ms each."""
    controller = DraftLengthController(4)
    for _ in range(EXPLORE + 4):
        controller.observe_pass("draft", 1, 10, draft_seconds)
        controller.observe_pass("verify", 2, 10, 0.005)
        controller.observe_pass("plain", 1, 10, 0.005)
    return controller


def test_rounds_keep_plain_decodings_cost_current():
    """A plain pass is a verification pass with no drafts, so the two share one cost fit: a cold
    first plain step (20 ms) is corrected by the verification passes rounds time (5 ms), and a
    draft whose rounds yield a token per 5.5 ms stops. With a fit of its own, plain decoding kept
    its cold timing while rounds ran, and those rounds looked 3.6x faster than plain decoding."""
    controller = DraftLengthController(4)
    history = controller.new_history()
    assert controller.choose([history], [3], [10]) == [0]  # nothing timed: a plain step first
    controller.observe_pass("plain", 1, 10, 0.020)
    assert controller.choose([history], [3], [10]) == [3]  # then explore
    for i in range(30):
        controller.observe_round(history, 1, 1, 1, False)  # one draft a round, always right
        controller.observe_pass("draft", 1, 10, 0.006)
        controller.observe_pass("verify", 1 + i % 2, 10, 0.005)
    assert controller.costs.predict("plain", 1, 10) < 0.006
    assert controller.choose([history], [1], [10]) == [0]
    fixed = DraftLengthController(4, fixed=True)
    assert fixed.choose([fixed.new_history()], [3], [10]) == [3]


def priced(draft_seconds: float) -> DraftLengthController:
    """A controller whose one-draft rounds are always right: a round yields 2 tokens for two draft
    passes (the second writes the draft's K/V) and a 5 ms verification, plain decoding 1 token for
    5 ms."""
    controller = calibrated(draft_seconds)
    history = controller.new_history()
    for _ in range(EXPLORE + 4):
        controller.observe_round(history, 1, 1, 1, False)
    controller.history = history
    return controller


def test_a_round_must_promise_the_margin():
    """Rounds 11 % better than plain decoding by the fits are not taken (what the model leaves
    out and its errors cost a round about that), rounds 25 % better are."""
    close = priced(0.002)  # 2 tokens in 9 ms against 1 in 5 ms: 1.11x
    assert close.choose([close.history], [1], [10]) == [0]
    clear = priced(0.0015)  # 2 tokens in 8 ms: 1.25x
    assert clear.choose([clear.history], [1], [10]) == [1]


def test_rounds_are_priced_at_what_whole_rounds_take_not_at_what_their_passes_fits_add_up_to():
    """One-draft rounds always accepted: by the pass fits 2 tokens in 8 ms against plain
    decoding's 1 in 5 ms. But every other verification stalls (20 ms against 5): the fits lean on
    the fast passes, while whole rounds average 2 tokens in 14.5 ms. Priced at what its rounds
    have taken against what their passes' fits predicted, the controller decodes plainly within
    the spans it holds rounds for; plain steps, which take what the fit says, keep their price."""
    controller = priced(0.001)
    history, steps = controller.history, []
    for step in range(60):
        if controller.choose([history], [1], [10]) == [1]:
            controller.observe_round(history, 1, 1, 1, False)
            controller.observe_pass("first_draft", 1, 10, 0.001)
            controller.observe_pass("draft", 1, 11, 0.001)
            controller.observe_pass("verify", 2, 21, 0.020 if step % 2 else 0.005, 1)
            steps.append("round")
        else:
            controller.observe_pass("plain", 1, 10, 0.005)
            steps.append("plain")
    assert controller.costs.predict("verify", 2, 21, 1) < 0.008
    assert controller.costs.step_factor(True, 1) > 1.5
    assert controller.costs.step_factor(False, 1) == pytest.approx(1.0, abs=0.05)
    assert steps[-20:] == ["plain"] * 20, steps


def test_a_rounds_step_factor_counts_its_own_passes_only():
    """A round is timed from its first draft pass through its verification: a catch-up pass run
    beside a prompt between two rounds (a second, far above its fit) is not added to the next
    round, which takes what its passes' fits say."""
    costs = PassCosts()
    for kind, rows, seconds in (("first_draft", 1, 0.001), ("draft", 1, 0.001), ("verify", 2, 0.005),
                                ("catch_up", 40, 0.004)):
        costs.observe(kind, rows, 10 * rows, seconds, 1)
    for fit in costs.fits.values():
        assert fit.theta[0] > 0.0  # solved: the passes that follow are compared with it
    a_round = (("first_draft", 1, 0.001), ("draft", 1, 0.001), ("verify", 2, 0.005))
    for kind, rows, seconds in (*a_round, ("catch_up", 40, 1.0), *a_round):
        costs.observe(kind, rows, 10 * rows, seconds, 1)
    assert costs.step_factor(True, 1) == pytest.approx(1.0, abs=0.2)


def test_a_step_is_priced_at_what_such_steps_took_as_its_fit_learns_them():
    """A batch size's first passes are predicted by a fit that has not seen it yet (a batch of 32
    priced from passes of one sequence). The step factor compares what steps took with what the
    fits predict for them now, so the fit's prediction times the factor is what such steps took,
    however much of the error the fit has since learned (compared with the fits as they predicted
    then, the factor corrected it a second time: a draft model's plain steps over 32 summaries
    were priced at 2.7x what they took)."""
    costs = PassCosts()
    for _ in range(20):  # solved on passes of one sequence
        costs.observe("plain", 1, 100, 0.001)
        costs.fit("plain").theta
    for _ in range(8):
        costs.observe("plain", 32, 3200, 0.0035)
        priced = costs.predict("plain", 32, 3200)  # each step is priced, reading the fit
        assert priced * costs.step_factor(False, 32) == pytest.approx(0.0035, rel=0.05)


def test_a_batch_is_priced_on_its_own_rounds_not_on_the_engines():
    """Scene descriptions beside report summaries: the scene's drafts are always accepted, the
    summaries' (which drafted last) always rejected. A new sequence, with no round of its own,
    goes by the engine's rates and decodes plainly; the scene, left running after the summaries
    ended, is priced on its own rounds and drafts."""
    controller = priced(0.001)  # the scene's one-draft rounds (``controller.history``)
    summary = controller.new_history()
    for _ in range(30):
        controller.observe_round(controller.history, 1, 1, 1, False)
    for _ in range(60):
        controller.observe_round(summary, 1, 1, 0, False)
    assert controller.acceptance.rates(1)[1][0] < 0.3
    assert controller.choose([controller.new_history()], [1], [10]) == [0]
    assert controller.choose([controller.history], [1], [10]) == [1]


def test_sampled_rounds_are_priced_on_sampled_acceptance_and_greedy_ones_on_greedy():
    """Greedy rounds whose drafts are always accepted, sampled rounds (temperature 0.7) whose
    drafts the rejection sampler always rejects, on the same engine. A fresh greedy sequence
    drafts; a fresh sampled one, priced on its regime's rounds, decodes plainly. A regime no round
    has run in yet (temperature 1.0) explores instead of borrowing another regime's rates. Once
    sampled rounds are accepted again, sampled sequences draft again."""
    controller = priced(0.001)  # greedy one-draft rounds, always right, pay
    sampled = regime(0.7, 1.0)

    def fresh(key="greedy") -> list[int]:  # a new sequence's step, priced (no decision held)
        controller._hold = None
        return controller.choose([controller.new_history(key)], [1], [10])

    for _ in range(30):
        controller.observe_round(controller.new_history(sampled), 1, 1, 0, False)
    assert fresh() == [1] and fresh(sampled) == [0]
    assert fresh(regime(1.0, 1.0)) == [1]  # nothing known of it: explores
    for _ in range(60):
        controller.observe_round(controller.new_history(sampled), 1, 1, 1, False)
    assert fresh(sampled) == [1] and fresh() == [1]


def test_a_sequence_drafts_in_the_regime_its_sampling_parameters_name():
    spec = ScriptedPair(lambda seq_id, position: True, lambda rows: 1e-3, lambda rows: 1e-3)
    greedy, sampled = sequences(2)
    sampled.params = SamplingParams(max_tokens=10_000, temperature=0.7, top_p=0.9)
    assert spec._history(greedy).regime == "greedy"
    assert spec._history(sampled).regime == regime(0.7, 0.9) != regime(0.7, 1.0)


def test_plain_decisions_are_held_for_doubling_spans_until_the_batch_changes():
    """After a priced plain decision the next steps decode plainly without planning: 1 step, then
    2, 4, 8 (so 3 of the first 8 steps are priced), through sequences ending within the batch's
    size class (1, 2-3, 4-7, ...). A batch whose class changed, or that a sequence joined, is
    priced at once, as it is now, its spans starting again at 1; a round starts the plain spans
    again at 1 too."""
    controller = priced(0.0024)
    h = controller.history
    for _ in range(8):
        assert controller.choose([h, h], [1, 1], [10, 10]) == [0, 0]
    assert controller.planned == 3  # held 1, 2 and 2 of 4 steps
    controller.choose([h] * 3, [1] * 3, [10] * 3)  # 3: the class of 2, held
    assert controller.planned == 3
    for planned in (4, 4, 5):  # a larger class: priced, held 1 step, priced
        controller.choose([h] * 5, [1] * 5, [10] * 5)
        assert controller.planned == planned
    controller.choose([h], [1], [10])  # a smaller class
    assert controller.planned == 6
    controller.choose([h], [1], [10])
    controller.choose([h, controller.new_history()], [1, 1], [10, 10])  # a join
    assert controller.planned == 7
    for _ in range(EXPLORE + 4):  # drafting becomes cheap: the smaller class is priced and drafts
        controller.observe_pass("draft", 1, 10, 0.001)
    assert controller.choose([h], [1], [10]) == [1] and controller.planned == 8
    assert controller.choose([h], [1], [10]) == [1] and controller.planned == 8  # the round, held
    for _ in range(60):  # drafting costs more: plain decoding again, held 1 step
        controller.observe_pass("draft", 1, 10, 0.003)
        controller.costs.fit("draft").theta  # read: each pass is weighed against the last fit
    assert [controller.choose([h], [1], [10]) for _ in range(3)] == [[0]] * 3
    assert controller.planned == 10


def test_a_held_plain_step_leaves_the_cost_fits_alone_and_a_priced_one_teaches_them():
    """The fits are read only where a decision is priced, so the pass of a step that keeps a held
    plain decision is not learned from (in a batch the controller decodes plainly, learning every
    step cost about 1 % of the run); the pass of each step that was priced is."""
    controller = priced(0.0024)  # plain decoding pays
    h, taught = controller.history, []
    for _ in range(8):
        planned, before = controller.planned, controller.costs.counts["plain"]
        assert controller.choose([h], [1], [10]) == [0]
        controller.observe_pass("plain", 1, 10, 0.005)
        taught.append((controller.planned - planned, controller.costs.counts["plain"] - before))
    assert taught == [(1, 1), (0, 0), (1, 1), (0, 0), (0, 0), (1, 1), (0, 0), (0, 0)], taught


def test_after_hold_max_plain_steps_a_round_probes_acceptance_where_a_sure_draft_would_pay():
    """Plain decoding learns nothing of acceptance: after ``HOLD_MAX`` plain steps one round is
    taken (every sequence at its limit), and the count starts again. Where not even a draft that
    is always right would pay (a draft pass dearer than a plain step), none is."""
    controller = priced(0.001)  # cheap drafts, but all rejected lately
    h = controller.history
    for _ in range(60):
        controller.observe_round(h, 1, 1, 0, False)
    chosen = [controller.choose([h], [1], [10]) for _ in range(3 * HOLD_MAX)]
    probes = [i for i, caps in enumerate(chosen) if caps == [1]]
    assert len(probes) == 2 and probes[0] >= HOLD_MAX and probes[1] - probes[0] > HOLD_MAX, probes
    controller = priced(0.006)
    chosen = [controller.choose([controller.history], [1], [10]) for _ in range(3 * HOLD_MAX)]
    assert chosen == [[0]] * (3 * HOLD_MAX)


def test_a_held_step_does_not_read_the_sequences_state():
    """``decide`` reads the sequences' lengths, progress and debts (``state()``) only for a step it
    prices or explores: a step that keeps a held plain decision or a held round plans without
    them, and a held plain step reads not even their limits (``limits()``)."""
    def unread():
        raise AssertionError("a held step read what it needs not")

    limits, state = lambda: [1, 1], lambda: ([10, 10], None, None)
    for draft_seconds, caps, held_limits, held_caps in (
            (0.0024, [0, 0], unread, [0, 0]),  # held plain: its limits unread
            (0.0015, [1, 1], lambda: [1, 0], [1, 0])):  # held round: its limits
        controller = priced(draft_seconds)
        h = controller.history
        assert controller.decide([h, h], limits, state) == caps and controller.planned == 1
        assert controller.decide([h, h], held_limits, unread) == held_caps and controller.planned == 1


def test_a_sequence_joining_the_batch_ends_a_plain_hold():
    """A plain decision made for some sequences is not held over a batch that a sequence has
    joined since (every token of the new one lies ahead): that step is priced; the next ones,
    with no one new, are held again."""
    controller = priced(0.0024)
    h = controller.history
    for _ in range(6):
        controller.choose([h, h], [1, 1], [10, 10])
    assert controller.planned == 3  # held 1 and 2 steps, then priced: a span of 4 left
    joined = controller.new_history()
    assert controller.choose([h, joined], [1, 1], [10, 10]) == [0, 0]
    assert controller.planned == 4
    controller.choose([h, joined], [1, 1], [10, 10])
    assert controller.planned == 4


def test_rounds_are_held_for_doubling_spans_until_a_sequence_joins_or_the_batch_changes_class():
    """After a priced round the next steps draft without planning: 1 round, then 2, 4, 8, 16, 16
    ... (``ROUND_HOLD_MAX``), through sequences ending within the batch's size class, until a
    sequence joins or the class changes: then the batch is priced as it is now."""
    controller = priced(0.0015)  # drafting pays
    h, other = controller.history, controller.new_history()
    assert [controller.choose([h, h], [1, 1], [10, 10]) for _ in range(40)] == [[1, 1]] * 40
    assert controller.planned == 6  # priced at steps 1, 3, 6, 11, 20 and 37 (held 3 of 16 since)
    assert controller.choose([h, h, h], [1, 1, 0], [10] * 3) == [1, 1, 0]  # held, its limits
    assert controller.planned == 6
    assert controller.choose([h, other], [1, 1], [10, 10]) == [1, 1] and controller.planned == 7
    controller.choose([h], [1], [10])
    assert controller.planned == 8


def test_an_arrival_reprices_the_batch():
    """Rows are dear (a pass costs 10 ms and 3 ms a row, verification and plain decoding alike; a
    draft pass 0.5 ms) and one-draft rounds are accepted nine times in ten: a round pays for 4
    sequences (1.19x) and not for 7 (1.11x, short of the margin). Four sequences draft, held;
    three arrive (the batch stays in its size class), and the very next step, priced on the
    batch as it now is, decodes plainly."""
    controller = DraftLengthController(1)
    for batch in (1, 2, 4, 8):
        for _ in range(3):
            controller.observe_pass("plain", batch, 10 * batch, 0.010 + 0.003 * batch)
            controller.observe_pass("verify", 2 * batch, 20 * batch, 0.010 + 0.006 * batch, batch)
            controller.observe_pass("first_draft", batch, 10 * batch, 0.0005)
            controller.observe_pass("draft", batch, 10 * batch, 0.0005)
    earlier = controller.new_history()
    for i in range(100):
        controller.observe_round(earlier, 1, 1, int(i % 10 != 0), False)
    four = [controller.new_history() for _ in range(4)]
    assert [controller.choose(four, [1] * 4, [10] * 4) for _ in range(4)] == [[1] * 4] * 4
    planned, three = controller.planned, [controller.new_history() for _ in range(3)]
    assert controller.choose(four + three, [1] * 7, [10] * 7) == [0] * 7
    assert controller.planned == planned + 1


def test_speculation_stops_within_a_few_steps_of_its_drafts_going_wrong_and_returns_when_they_recover():
    """Four sequences whose drafts are always right draft their limit. Four new ones come whose
    drafts are always wrong: within 4 steps the controller decodes plainly. Their drafts turn
    right again: the probes after ``HOLD_MAX`` plain steps see it, and within three of them the
    batch drafts again."""
    good = {"right": True}
    spec = ScriptedPair(lambda seq, pos: good["right"], draft_ms, verify_ms)
    assert all(g == [LIMIT] * 4 for g in decode(spec, sequences(4), 30, plain_ms)[-10:])
    good["right"], seqs = False, sequences(4)
    chosen = decode(spec, seqs, 4 + HOLD_MAX // 2, plain_ms)
    assert not any(map(any, chosen[4:])), chosen
    good["right"] = True
    chosen = decode(spec, seqs, 3 * HOLD_MAX + 10, plain_ms)
    assert all(g == [LIMIT] * 4 for g in chosen[-10:]), chosen


def test_a_step_where_no_sequence_may_draft_starts_no_hold():
    """Sequences at their last token may draft nothing: that step is not priced, so it holds no
    decision over the next step, whose sequences may draft."""
    controller = priced(0.0015)  # drafting pays
    h = controller.history
    assert controller.choose([h], [0], [10]) == [0] and controller.planned == 0
    assert controller.choose([h], [1], [10]) == [1] and controller.planned == 1


def test_exploring_rounds_are_the_rounds_fixed_rounds_run_and_only_priced_rounds_draft_prompts():
    """An exploring step is a round as fixed rounds run it: every sequence nothing must catch up
    drafts its limit (a fresh engine's first round is the one fixed rounds run where speculation
    pays; early exit exploring with a quarter of the batch lost up to 3 % on scenes and the
    mixed workload at batches 8 to 32). ``drafting_lately`` (a draft model follows prompts at
    prefill) turns on with a priced round, not with exploring ones (a fresh batch of short answers
    would pay for every prompt's draft), and off with a priced plain decision."""
    controller, fixed = DraftLengthController(4), DraftLengthController(4, fixed=True)
    histories = [controller.new_history() for _ in range(5)]
    assert not controller.drafting_lately()  # nothing ran yet: the draft waits for a round
    controller.observe_pass("plain", 5, 50, 0.001)
    limits = [3, 0, 3, 1, 3]
    assert controller.choose(histories, limits, [10] * 5) == limits
    assert fixed.choose(histories, limits, [10] * 5) == limits
    for _ in range(EXPLORE):
        assert controller.choose(histories, [3] * 5, [10] * 5) == [3] * 5
        for h in histories:
            controller.observe_round(h, 3, 3, 3, False)
        controller.observe_pass("draft", 5, 50, 0.0001)
        controller.observe_pass("verify", 20, 50, 0.001)
    assert not controller.drafting_lately() and controller.planned == 0
    assert controller.choose(histories, [3] * 5, [10] * 5) == [3] * 5 and controller.drafting_lately()
    for _ in range(60):
        controller.observe_pass("draft", 1, 10, 100.0)
        controller.costs.fit("draft").theta
    controller._hold = None
    assert controller.choose(histories, [3] * 5, [10] * 5) == [0] * 5 and not controller.drafting_lately()


def test_a_draft_models_first_round_catches_up_only_the_least_behind_share_of_the_batch():
    """A draft model must catch up on the prompts it skipped before it drafts. A fresh controller's
    first round, not yet known to pay, drafts for the 1 in ``first_share`` sequences of the batch
    its draft is least behind on (and every one it is not behind on): a batch of two- to
    eight-token answers ends within a round or two, and catching up all of it made that round
    cost about four plain steps. Once a verification is timed, exploring rounds draft for every
    sequence; early exit (never behind) explores with all of them from its first round."""
    def first_round(behind, batch=8):
        controller = DraftLengthController(4)
        histories = [controller.new_history() for _ in range(batch)]
        controller.observe_pass("plain", batch, 10 * batch, 0.001)
        return controller, histories, controller.choose(histories, [3] * batch, [10] * batch,
                                                        behind=behind)

    assert first_round([40, 10, 30, 0, 50, 20, 60, 70])[2] == [0, 3, 0, 3, 0, 0, 0, 0]
    assert first_round([0, 9, 0, 5, 0, 7, 1, 8])[2] == [3, 0, 3, 0, 3, 0, 0, 0]  # caught up: free
    assert first_round([6, 2, 9], batch=3)[2] == [0, 3, 0]
    assert first_round(None)[2] == [3] * 8
    controller, histories, _ = first_round([40] * 8)
    for h in histories[:2]:
        controller.observe_round(h, 3, 3, 3, False)
    controller.observe_pass("catch_up", 80, 800, 0.00001, 2)
    controller.observe_pass("draft", 2, 100, 0.0001)
    controller.observe_pass("verify", 16, 100, 0.001, 8)
    assert controller.choose(histories, [3] * 8, [10] * 8, behind=[40] * 6 + [0] * 2) == [3] * 8


def test_a_calibrated_controller_explores_in_one_step():
    """On an engine whose passes are timed already (its calibration), a batch of at least
    ``EXPLORE`` sequences explores for one step, every sequence at its limit, and the next step is
    priced."""
    controller = DraftLengthController(4, costs=priced(0.0015).costs)
    histories = [controller.new_history() for _ in range(8)]
    assert controller.choose(histories, [3] * 8, [10] * 8) == [3] * 8 and controller.planned == 0
    for history in histories:
        controller.observe_round(history, 3, 3, 3, False)
    assert controller.choose(histories, [3] * 8, [10] * 8) == [3] * 8 and controller.planned == 1


def test_a_step_that_carries_prompt_chunks_does_not_explore():
    """Plain decoding rides the pass of a step's prompt chunks at little cost; an exploring round
    beside them is a verification pass of its own (a batch of 32 summaries explored while its
    last prompts were prefilled, about 5 ms a step). So such a step decodes plainly, holding
    nothing, and the next step without prompts explores."""
    controller = DraftLengthController(4)
    controller.observe_pass("plain", 3, 30, 0.001)
    histories = [controller.new_history() for _ in range(3)]
    limits, state = lambda: [3] * 3, lambda: ([10] * 3, None, None)
    assert controller.decide(histories, limits, state, beside_prompts=True) == [0] * 3
    assert controller.decide(histories, limits, state) == [3] * 3


def trained_on_catch_ups() -> tuple[DraftLengthController, list]:
    """Three sequences with a draft always right, rounds of 4 drafts that pay well, and a
    catch-up pass costing 0.1 ms and 1 us a row."""
    controller = DraftLengthController(4)
    histories = [controller.new_history() for _ in range(3)]
    for _ in range(6):
        for h in histories:
            controller.observe_round(h, 4, 4, 4, False)
        controller.observe_pass("draft", 3, 3 * 4000, 0.0001 + 0.00001 * 3)
        for rows in (300, 3000):  # catch-up passes of one sequence
            controller.observe_pass("catch_up", rows, rows * 4000, 0.0001 + 0.000001 * rows, 1)
        for rows in (3, 15):
            controller.observe_pass("verify", rows, rows * 4000, 0.002 + 0.00001 * rows)
        controller.observe_pass("plain", 3, 12000, 0.002 + 0.00001 * 3)
    return controller, histories


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(1, 7), st.sampled_from([100, 2000]),
                          st.sampled_from([0, 50]), st.integers(0, 4)), min_size=1, max_size=8),
       st.lists(st.integers(1, 12), max_size=20))
def test_a_round_is_priced_as_the_sum_over_its_sequences(batch, recorded):
    """The price of a round against its definition, sequence by sequence (the controller prices
    alike sequences once): with ``S`` a sequence's survival (0 from its cap on) and ``D``, ``A``
    the batch's rates, it yields ``1 + sum_j D_j A_j S_j`` tokens; draft pass ``j`` has a row for
    it with chance ``D_j S_(j-1)`` and runs unless no sequence has one; verification has its rows
    too; a catch-up is spread over the tokens the batch is still expected to generate. A round
    pays exactly when the margin is at most plain decoding's seconds a token over the round's."""
    sequences = [(generated, cap, size, behind, history) for generated, cap, size, behind, history in batch
                 if min(4, cap - 1) > 0] or [(0, 5, 100, 0, 0)]
    controller, trained = trained_on_catch_ups()
    for n in recorded:
        controller.lengths.record(n)
    fresh = [controller.new_history(), controller.new_history()]
    histories = [(trained + fresh)[h] for *_, h in sequences]
    limits = [min(4, cap - 1) for _, cap, *_ in sequences]
    lengths, behind = [size for _, _, size, *_ in sequences], [b for *_, b, _ in sequences]
    progress = [(generated, cap) for generated, cap, *_ in sequences]
    depth, costs = max(limits), controller.costs
    proposed, accepted = controller.acceptance.batch_rates(histories, depth)
    drafts, accepts = [1.0], [1.0]  # D_j, A_j from j = 0
    for p, a in zip(proposed, accepted):
        drafts.append(drafts[-1] * p)
        accepts.append(accepts[-1] * p * a)
    survival = controller.lengths.survival([g for g, _ in progress], 4)
    tokens = running = attended = 0.0
    rows, idle = [0.0] * (depth + 1), [1.0] * (depth + 1)
    for (generated, cap), limit, size in zip(progress, limits, lengths):
        chance = [survival[generated][i] if i < cap else 0.0 for i in range(5)]
        running += sum(chance)
        tokens += 1.0
        for j in range(1, limit + 1):
            tokens += drafts[j] * accepts[j] * chance[j]
            row = drafts[j] * chance[j - 1]  # draft pass j computes draft j + 1 after draft j
            rows[j] += row
            idle[j] *= 1.0 - row
            attended += (size + j) * row
    batch_size, context, theta = len(limits), float(sum(lengths)), costs.fit("draft").theta
    seconds = (costs.predict("first_draft", batch_size, context)
               + sum(costs.fixed("draft") * (1.0 - idle[j]) + (theta[1] + theta[2]) / 16 * rows[j]
                     for j in range(1, depth + 1)) + theta[3] / 16384 * attended
               + costs.predict("verify", batch_size + sum(rows), context + attended, batch_size))
    if any(behind):
        seconds += tokens / running * costs.predict(
            "catch_up", sum(behind), sum(b * (size - b / 2) for b, size in zip(behind, lengths)),
            sum(b > 0 for b in behind))
    ratio = costs.predict("plain", batch_size, context) / batch_size / (seconds / tokens)
    for margin, pays in ((ratio * (1 - 1e-9), True), (ratio * (1 + 1e-9), False)):
        controller.settings = Settings(round_margin=margin)
        assert controller._pays(histories, limits, lengths, progress, behind) is pays


def test_a_catch_up_is_paid_by_the_tokens_the_outputs_have_left():
    """A draft model behind by 3000 positions on one sequence (a prompt it skipped): the catch-up
    (3 ms, a plain step and a half) is spread over the tokens the batch is still expected to
    generate. With 300 tokens left each, the rounds soon repay it; with 2 left, they cannot; with
    none behind, a round pays either way."""
    limits, lengths = [4, 4, 4], [4000] * 3
    for left, behind, caps in ((300, [3000, 0, 0], [4, 4, 4]), (2, [3000, 0, 0], [0, 0, 0]),
                               (2, [0, 0, 0], [1, 1, 1])):
        controller, histories = trained_on_catch_ups()
        progress = [(0, left)] * 3
        assert controller.choose(histories, [min(4, left - 1)] * 3, lengths, progress, behind) == caps


def test_a_catch_up_is_spread_over_at_most_num_tokens_of_each_output():
    """A catch-up of 8,000 positions (about 15 ms) against rounds 3.6x faster than plain decoding,
    spread over at most ``num_tokens`` more tokens of each output, does not pay, on a fresh engine
    or once outputs are seen to run 400 tokens (spreading it further measured no faster)."""
    controller, histories = trained_on_catch_ups()
    progress, behind = [(0, 400)] * 3, [8000, 0, 0]
    assert controller.choose(histories, [4] * 3, [8000] * 3, progress, behind) == [0] * 3
    for _ in range(10):
        controller.lengths.record(400)
    controller._hold = None
    assert controller.choose(histories, [4] * 3, [8000] * 3, progress, behind) == [0] * 3


def test_drafts_past_where_recent_outputs_ended_are_worth_nothing():
    """Rounds of a draft always right, and a catch-up to pay: with no output finished yet, the
    sequences (2 tokens generated) are expected to run to their limit and the round pays; once
    recent outputs ended after 3 tokens, each has about one token left and it does not."""
    controller, histories = trained_on_catch_ups()
    progress, behind = [(2, 100)] * 3, [500, 500, 500]
    assert controller.choose(histories, [4] * 3, [4000] * 3, progress, behind) == [4] * 3
    for _ in range(10):
        controller.lengths.record(3)
    controller._hold = None
    assert controller.choose(histories, [4] * 3, [4000] * 3, progress, behind) == [0] * 3


def test_a_sequence_behind_a_running_one_is_expected_to_run_as_far():
    """Recent outputs all ended after 3 tokens, and two sequences of the batch have run past
    them: one of 5 tokens behind one of 40 that is still running. The one behind is expected to
    go on as far as the one ahead has (it is not expected to end just because every output that
    ended was short); the one ahead, past anything known, ends at the recorded outputs' rate
    (one end in 3 tokens). A round pays."""
    controller, histories = trained_on_catch_ups()
    for _ in range(10):
        controller.lengths.record(3)
    survival = controller.lengths.survival([5, 40], 4)
    assert survival[5] == pytest.approx([1.0] * 5)
    assert survival[40] == pytest.approx([(2 / 3) ** i for i in range(5)])
    progress, behind = [(5, 100), (5, 100), (40, 100)], [500, 500, 500]
    assert controller.choose(histories, [4] * 3, [4000] * 3, progress, behind) == [4] * 3


def test_sequences_past_every_recorded_output_run_on_at_the_recorded_rate():
    """A mixed batch: report summaries ended after 25 tokens, and the scene descriptions beside
    them are still running at 30, the draft model behind on each. Nothing recorded reached 31, so
    each scene ends at the summaries' rate (one end in 25 tokens), not at once: rounds of a draft
    always right pay, the catch-up with them. Had the recorded outputs ended after 2 tokens (short
    answers), the same sequences would be expected to end within a token or two, and plain
    decoding kept."""
    for ran, caps in ((25, [4] * 3), (2, [0] * 3)):
        controller, histories = trained_on_catch_ups()
        for _ in range(16):
            controller.lengths.record(ran)
        survival = controller.lengths.survival([30] * 3, 4)
        assert survival == {30: pytest.approx([(1 - 1 / ran) ** i for i in range(5)])}
        progress = [(30, 18)] * 3
        assert controller.choose(histories, [4] * 3, [4000] * 3, progress, [500] * 3) == caps


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 60), max_size=40), st.lists(st.integers(0, 60), min_size=1, max_size=6),
       st.integers(0, 12))
def test_survival_is_the_product_limit_estimate_over_recent_and_running_outputs(finished, generated,
                                                                               positions):
    """Against the definition, computed naively, length by length: going past ``m`` is one less
    the share of the outputs that reached ``m`` (recent ones at least ``m`` long, and running ones
    that generated ``m``) that ended there (recent ones exactly ``m`` long); where none reached
    ``m``, one less the recorded outputs' ends per token they ran; 1 when nothing was recorded.
    Where no running sequence is ahead and a recent output ran past ``g``, it is the share of
    recent outputs longer than ``g`` that ran ``g + 1 + i`` or further."""
    lengths = OutputLengths()
    for n in finished:
        lengths.record(n)
    got = lengths.survival(generated, positions)
    assert sorted(got) == sorted(set(generated))
    for g, row in got.items():
        expected, chance = [1.0], 1.0
        for m in range(g + 1, g + 1 + positions):
            if not finished:  # nothing recorded: 1
                expected.append(1.0)
                continue
            reached = sum(n >= m for n in finished) + sum(k >= m for k in generated)
            ended = sum(n == m for n in finished)
            chance *= 1.0 - ended / reached if reached else 1.0 - len(finished) / sum(finished)
            expected.append(chance)
        assert row == pytest.approx(expected)
        past = [n for n in finished if n > g]
        if past and max(generated) <= g:
            assert row == pytest.approx([sum(n >= g + 1 + i for n in past) / len(past)
                                for i in range(positions + 1)])


def test_linear_fit_recovers_a_linear_cost_and_clips_spikes():
    fit = LinearFit(decay=1.0, ridge=1e-9)
    for rows, context in ((1, 100), (8, 900), (32, 5000), (16, 1000), (4, 4000)):
        fit.observe(rows, context, 2.0 + 0.25 * rows + 0.001 * context)
    assert fit.predict(20, 3000) == pytest.approx(2.0 + 5.0 + 3.0, rel=1e-6)
    fit.observe(20, 3000, 1000.0)  # a stall: counted as at most 3 x the prediction
    assert fit.predict(20, 3000) < 3 * 10.0


def test_a_fit_read_before_any_pass_does_not_clip_the_passes_that_follow():
    """A fit read before it has seen a pass (a plan priced before the first catch-up pass was
    timed) predicts nothing; the passes that follow are not clipped to ``SPIKE`` times that
    nothing, so the fit learns what they took."""
    fit = LinearFit()
    assert fit.predict(400, 40_000, 4) == pytest.approx(0.0, abs=1e-6)
    for _ in range(3):
        fit.observe(400, 40_000, 0.004, 4)
    assert fit.predict(400, 40_000, 4) == pytest.approx(0.004, rel=0.05)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 800), st.integers(1, 64), st.integers(0, 40_000), st.booleans(),
                          st.floats(1e-4, 5e-2), st.integers(0, 40)), min_size=1, max_size=300))
@example([(r, 1 + r % 3, 100 * r, r % 2 == 0, 0.001 * (1 + r % 5), int(r != 30)) for r in range(1, 200)])
def test_each_observation_is_weighed_against_the_fit_solved_at_the_last_read(steps):
    """The fit is solved only when read (a step whose last field is 0 reads it first). Against
    folding each observation into decayed sums in numpy-free reference arithmetic, weighed against
    the fit solved at the last read (slower than its prediction: ``SLOW_WEIGHT``, at most
    ``SPIKE`` times it), so passes between two reads never move the fit they are weighed by."""
    fit = LinearFit()
    gram = [[0.0] * cost_model.NUM_FEATURES for _ in range(cost_model.NUM_FEATURES)]
    moment = [0.0] * cost_model.NUM_FEATURES
    solved = None
    for rows, sequences, context, extra, seconds, read in steps:
        if read == 0:
            theta = fit.theta
            solved = theta if gram[0][0] > 0.0 else solved
        fit.observe(rows, context, seconds, sequences, extra)
        x = cost_model._features(rows, context, sequences, extra)
        w = 1.0
        if solved is not None:
            expected = max(sum(t * f for t, f in zip(solved, x)), 1e-7)
            if seconds > expected:
                seconds, w = min(seconds, cost_model.SPIKE * expected), cost_model.SLOW_WEIGHT
        moment = [fit.decay * m + w * f * seconds for m, f in zip(moment, x)]
        gram = [[fit.decay * g + w * a * b for g, b in zip(row, x)] for row, a in zip(gram, x)]
    folded_gram, folded_moment = fit.gram, fit.moment
    assert folded_moment == pytest.approx(moment, rel=1e-9, abs=1e-15)
    for got, want in zip(folded_gram, gram):
        assert got == pytest.approx(want, rel=1e-9, abs=1e-15)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.none() | st.tuples(st.integers(1, 800), st.integers(1, 64), st.integers(0, 40_000),
                                      st.booleans(), st.floats(1e-4, 5e-2)), min_size=1, max_size=40))
def test_linear_fit_is_the_least_squares_fit_whose_slopes_are_not_negative(passes):
    """Against projected coordinate descent on the same (ridge, decayed) objective: the fit's
    slopes are at least 0 and no feasible fit has a smaller error, whichever free slopes the
    reads between the passes (``None``) left the next solve to start from."""
    fit = LinearFit()
    for step in passes:
        if step is None:
            fit.theta
            continue
        rows, sequences, context, extra, seconds = step
        fit.observe(rows, context, seconds, sequences, extra)
    theta = fit.theta
    assert min(theta[1:]) >= 0.0
    n, gram, moment = len(theta), fit.gram, fit.moment
    a = [[g + (fit.ridge if i == j else 0.0) for j, g in enumerate(row)] for i, row in enumerate(gram)]
    oracle = [0.0] * n
    for _ in range(3000):
        for i in range(n):
            value = (moment[i] - sum(a[i][j] * oracle[j] for j in range(n) if j != i)) / a[i][i]
            oracle[i] = value if i == 0 else max(0.0, value)

    def objective(t):  # t' A t - 2 t' m
        return sum(t[i] * (sum(a[i][j] * t[j] for j in range(n)) - 2.0 * moment[i]) for i in range(n))

    assert objective(theta) <= objective(oracle) + 1e-9 * max(1.0, abs(objective(oracle)))


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 800), st.integers(1, 64), st.integers(0, 40_000),
                          st.booleans(), st.floats(1e-4, 5e-2)), min_size=1, max_size=40))
def test_the_fit_is_the_best_over_every_set_of_free_slopes(passes):
    """Against trying every set of free slopes (the others held at 0): the best feasible one of
    those 16 ridge solves is the constrained optimum, and the active set finds it."""
    fit = LinearFit()
    for rows, sequences, context, extra, seconds in passes:
        fit.observe(rows, context, seconds, sequences, extra)
    moment = np.array(fit.moment)
    a = np.array(fit.gram) + fit.ridge * np.eye(len(moment))

    def objective(t):
        return t @ a @ t - 2.0 * t @ moment

    best = None
    for mask in range(16):
        free = [0, *(i for i in range(1, 5) if mask >> (i - 1) & 1)]
        t = np.zeros(5)
        t[free] = np.linalg.solve(a[np.ix_(free, free)], moment[free])
        if min(t[1:]) >= 0.0 and (best is None or objective(t) < objective(best)):
            best = t
    theta = np.array(fit.theta)
    assert min(theta[1:]) >= 0.0
    assert objective(theta) == pytest.approx(objective(best), rel=1e-9, abs=1e-15)


def test_a_long_verification_is_priced_from_plain_steps_by_its_rows_and_sequences():
    """A pass costs mostly per sequence (metadata, attention calls, sampling), little per extra
    row of a sequence, and a verification pass a little more than a plain one. Timed on plain
    steps at batch 1 to 32 and on short verifications at batch 8, the target fit prices a
    32-sequence verification of 25 rows each within 5 %; fitted on rows alone it read the
    per-sequence cost as a per-row one and priced that pass at more than three times its cost."""
    def seconds(rows, sequences, verify):
        return 0.6e-3 + 0.14e-3 * sequences + 0.017e-3 * rows + 0.3e-3 * verify

    costs = PassCosts()
    for step in range(120):
        batch = (1, 2, 4, 8, 16, 32)[step % 6]
        costs.observe("plain", batch, 30 * batch, seconds(batch, batch, False))
        if step % 3 == 0:
            rows = 8 * (2 + step % 5)
            costs.observe("verify", rows, 30 * rows, seconds(rows, 8, True), 8)
    assert costs.predict("verify", 800, 24_000, 32) == pytest.approx(seconds(800, 32, True), rel=0.05)
    assert costs.predict("plain", 32, 960) == pytest.approx(seconds(32, 32, False), rel=0.05)


def test_a_pass_in_which_a_kernel_was_built_is_not_timed(monkeypatch):
    """The first pass at a row count builds oneDNN kernels and takes 2-3x the next one of its
    shape: the controller is told the passes that did not build one."""
    spec = ScriptedPair(lambda seq, pos: True, draft_ms, verify_ms)
    start = spec.started()
    spec.clock.now += 0.005
    spec.observe("plain", 4, 40, start)
    assert spec.controller.costs.counts["plain"] == 1
    start = spec.started()
    monkeypatch.setattr(packed_linear, "_BUILT", packed_linear._BUILT | {(-1, 0, 0)})  # a build
    spec.clock.now += 0.015
    spec.observe("plain", 4, 40, start)
    assert spec.controller.costs.counts["plain"] == 1


def test_a_verification_is_timed_through_the_work_on_its_verdicts():
    """The caller's work on a round's verdicts (appending tokens, truncating tables, finishing
    sequences) is part of the round's cost, as the same work is of a plain step's: the
    verification pass is told to the controller once the caller has applied the verdicts, with
    the time up to then."""
    spec = ScriptedPair(lambda seq, pos: True, draft_ms, verify_ms)
    seen = []
    spec.controller.observe_pass = lambda kind, rows, context, seconds, sequences=None: seen.append(
        (kind, rows, seconds))
    spec.round(sequences(1), [2], [set()])
    assert [kind for kind, _, _ in seen] == ["first_draft", "draft", "draft"]
    spec.clock.now += 4.0  # the caller applies the verdicts
    spec.round_applied()
    assert seen[-1] == ("verify", 3, pytest.approx(verify_ms(3) + 4.0))
    spec.round_applied()  # nothing more to time
    assert len(seen) == 4


def test_bad_draft_length_mode_is_refused_by_name():
    with pytest.raises(ValueError, match="draft_length"):
        SpeculativeConfig(draft_length="sometimes")
