"""The acceptance model's rates: a first draft is tried, and a position no round has reached is
expected to go as the deepest position reached, not to be proposed and accepted for sure."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from speculative.acceptance import BATCH_PRIOR, DECAY, PRIOR, AcceptanceModel, DraftHistory


def test_an_untried_model_expects_every_draft_proposed_and_accepted():
    proposed, accepted = AcceptanceModel(6).rates(6)
    assert list(proposed) == list(accepted) == [1.0] * 6


def test_positions_no_round_reached_go_as_the_deepest_one_reached():
    """Rounds of two drafts: the second is proposed half the time and accepted half the time it
    is proposed. Positions 3 to 8 were never reached: they inherit position 2's rates."""
    model = AcceptanceModel(8)
    history = DraftHistory()
    for i in range(20):
        stopped = i % 2 == 0  # the draft's confidence stops it before the second token
        model.observe(history, 2, 1 if stopped else 2, 1 if stopped or i % 4 == 1 else 2, stopped)
    proposed, accepted = model.rates(8)
    assert proposed[0] == pytest.approx(1.0) and accepted[0] == pytest.approx(1.0)
    assert 0.4 < proposed[1] < 0.6 and 0.4 < accepted[1] < 0.65
    assert list(proposed[2:]) == pytest.approx([proposed[1]] * 6)
    assert list(accepted[2:]) == pytest.approx([accepted[1]] * 6)
    assert history.drafted == 30


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 4), st.booleans(), st.integers(1, 5)),
                min_size=1, max_size=25))
def test_rates_are_the_decayed_counts_chained_position_by_position(events):
    """Each event: a round allowed ``chosen`` drafts (0: no observation) proposes and accepts
    some, then the rates up to ``limit`` are read. Against counts kept naively: every earlier
    sequence-round weighs ``DECAY`` per round since, and each position's rate is shrunk toward the
    one before it with the weight of ``PRIOR`` trials."""
    model = AcceptanceModel(5)
    rounds: list[tuple[list[bool], list[bool]]] = []
    for chosen, proposed, stopped, limit in events:
        proposed = min(proposed, chosen)
        accepted = max(0, proposed - 1) if stopped else proposed
        model.observe(DraftHistory(), chosen, proposed, accepted, stopped and proposed < chosen)
        if chosen:
            rounds.append(([True] * proposed + ([False] if stopped and proposed < chosen else []),
                           [True] * accepted + ([False] if accepted < proposed else [])))
        got = model.rates(limit)
        for which in (0, 1):
            before, want = 1.0, []
            for j in range(limit):
                hits = trials = 0.0
                for age, outcomes in enumerate(reversed([r[which] for r in rounds])):
                    if j < len(outcomes[:5]):
                        trials += DECAY ** age
                        hits += DECAY ** age * outcomes[j]
                before = (hits + PRIOR * before) / (trials + PRIOR)
                want.append(before)
            assert list(got[which]) == pytest.approx(want)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 4), st.integers(0, 4), st.booleans()),
                max_size=30), st.sets(st.integers(0, 3)), st.integers(1, 5))
def test_a_batch_is_priced_on_its_own_rounds_shrunk_toward_the_engines_rates(rounds, batch, limit):
    """Rounds of four sequences (``(sequence, proposed, accepted, stopped)``, each allowed 4);
    a batch of some of them: at each position the hits over the trials of its sequences' rounds,
    with the engine's rate weighing ``BATCH_PRIOR`` trials, counted naively; the engine's rates
    alone where none of the batch has drafted."""
    model = AcceptanceModel(5)
    histories = [DraftHistory() for _ in range(4)]
    kept: dict[int, list[tuple[int, int, bool]]] = {i: [] for i in range(4)}
    for seq, proposed, accepted, stopped in rounds:
        accepted = min(accepted, proposed)
        stopped = stopped and proposed < 4
        model.observe(histories[seq], 4, proposed, accepted, stopped)
        kept[seq].append((proposed, accepted, stopped))
    engine = model.rates(limit)
    got = model.batch_rates([histories[i] for i in sorted(batch)], limit)
    for which in (0, 1):
        want = []
        for j in range(limit):
            hits = trials = 0.0
            for proposed, accepted, stopped in (r for i in batch for r in kept[i]):
                reached, made = ((proposed + stopped, proposed) if which == 0
                                 else (accepted + (accepted < proposed), accepted))
                trials += j < reached
                hits += j < made
            have_drafted = any(kept[i] for i in batch)
            want.append((hits + BATCH_PRIOR * engine[which][j]) / (trials + BATCH_PRIOR)
                        if have_drafted else engine[which][j])
        assert list(got[which]) == pytest.approx(want)
        assert all(0.0 <= rate <= 1.0 for rate in got[which])
