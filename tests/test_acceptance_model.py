"""The acceptance model's rates: a first draft is tried, and a position no round has reached is
expected to go as the deepest position reached, not to be proposed and accepted for sure."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from speculative.acceptance import DECAY, PRIOR, AcceptanceModel, DraftHistory


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
