"""The acceptance model's rates: a first draft is tried, and a position no round has reached is
expected to go as the deepest position reached, not to be proposed and accepted for sure."""

from __future__ import annotations

import pytest

from speculative.acceptance import AcceptanceModel


def test_an_untried_model_expects_every_draft_proposed_and_accepted():
    proposed, accepted = AcceptanceModel(6).engine_rates()
    assert proposed == accepted == [1.0] * 6


def test_positions_no_round_reached_go_as_the_deepest_one_reached():
    """Rounds of two drafts: the second is proposed half the time and accepted half the time it
    is proposed. Positions 3 to 8 were never reached: they inherit position 2's rates."""
    model = AcceptanceModel(8)
    history = model.new_history()
    for i in range(20):
        stopped = i % 2 == 0  # the draft's confidence stops it before the second token
        model.observe(history, 2, 1 if stopped else 2, 1 if stopped or i % 4 == 1 else 2, stopped)
    proposed, accepted = model.engine_rates()
    assert proposed[0] == pytest.approx(1.0) and accepted[0] == pytest.approx(1.0)
    assert 0.4 < proposed[1] < 0.6 and 0.4 < accepted[1] < 0.65
    assert proposed[2:] == pytest.approx([proposed[1]] * 6)
    assert accepted[2:] == pytest.approx([accepted[1]] * 6)
    mine, _ = model.rates([history, model.new_history()], 8)
    assert mine[0, 7] == pytest.approx(proposed[1])  # a sequence's untried position: the engine's
    assert list(mine[1]) == pytest.approx(proposed)  # a sequence with no round: the engine's rates
