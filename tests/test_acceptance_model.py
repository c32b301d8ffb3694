"""The acceptance model's rates: a first draft is tried, and a position no round has reached is
expected to go as the deepest position reached, not to be proposed and accepted for sure."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from speculative.acceptance import SHRINK, AcceptanceModel


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


def naive_rates(model: AcceptanceModel, history, limit: int) -> tuple[list[float], list[float]]:
    """One sequence's rates derived from its counts alone, position by position."""
    engine = model.engine_rates()
    return tuple([(c.hits[j] + SHRINK * everyone[j]) / (c.trials[j] + SHRINK) for j in range(limit)]
                 for c, everyone in ((history.proposed, engine[0]), (history.accepted, engine[1])))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 4), st.integers(0, 4), st.booleans(),
                          st.lists(st.integers(0, 3), min_size=1, max_size=6), st.integers(1, 5)),
                min_size=1, max_size=25))
def test_rates_kept_between_observations_are_the_rates_derived_afresh(events):
    """Each event: sequence ``who`` runs a round (allowed ``chosen`` drafts, proposing and
    accepting some, 0 allowed: no observation), then a batch of sequences (repeats allowed) asks
    for its rates up to ``limit``. Kept or derived again, every row is what the sequence's counts
    and the engine's give, position by position."""
    model = AcceptanceModel(5)
    histories = [model.new_history() for _ in range(4)]
    for who, chosen, proposed, stopped, batch, limit in events:
        proposed = min(proposed, chosen)
        accepted = proposed if who % 2 else max(0, proposed - 1)
        model.observe(histories[who], chosen, proposed, accepted, stopped and proposed < chosen)
        rows = model.rates([histories[b] for b in batch], limit)
        for r, b in enumerate(batch):
            want = naive_rates(model, histories[b], limit)
            assert list(rows[0][r]) == pytest.approx(want[0]) and list(rows[1][r]) == pytest.approx(want[1])
