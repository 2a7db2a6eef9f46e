"""The adaptive gate: the cost fit, the reach threshold it gives, and the per-request odds, on
synthetic timings (no clock is read)."""

from __future__ import annotations

import pytest

from radixserve.scheduler.request import SpeculationState
from radixserve.scheduler.speculative.cost import INITIAL_REACH_THRESHOLD, PLAIN_STEP_INTERVAL, StepCost
from radixserve.scheduler.speculative.ngram import NgramConfig, NgramIndex


def _fed(intercept: float, slope: float, sizes: list[int]) -> StepCost:
    cost = StepCost()
    for n in sizes:
        cost.observe(n, intercept + slope * n, plain=n == 1)
    return cost


def test_the_fit_recovers_a_linear_cost_and_prices_a_draft() -> None:
    # An AVX2-like machine: 10 ms per forward plus 6.6 ms per token.
    cost = _fed(0.010, 0.0066, [1, 8, 1, 4, 2, 8, 1])
    fitted = cost.fit()
    assert fitted is not None
    assert fitted[0] == pytest.approx(0.010) and fitted[1] == pytest.approx(0.0066)
    # One stream: a draft must be emitted with probability 6.6 / 16.6 to pay.
    assert cost.reach_threshold(1) == pytest.approx(0.0066 / 0.0166)
    # Eight streams decode eight tokens for 10 + 52.8 ms: a draft must be nearly certain.
    assert cost.reach_threshold(8) == pytest.approx(0.0066 / (0.0628 / 8))
    # An AMX-like machine: drafts are nearly free, anything plausible is worth a try.
    assert _fed(0.010, 0.0002, [1, 8, 1, 8]).reach_threshold(1) < 0.02


def test_until_two_sizes_were_seen_the_threshold_is_the_cautious_default() -> None:
    assert StepCost().reach_threshold(1) == INITIAL_REACH_THRESHOLD
    assert _fed(0.01, 0.005, [1, 1, 1]).reach_threshold(1) == INITIAL_REACH_THRESHOLD


def test_a_plain_step_is_asked_for_after_a_run_of_verify_steps() -> None:
    cost = StepCost()
    for _ in range(PLAIN_STEP_INTERVAL - 1):
        cost.observe(8, 0.05, plain=False)
    assert not cost.needs_plain_step
    cost.observe(8, 0.05, plain=False)
    assert cost.needs_plain_step
    cost.observe(1, 0.02, plain=True)
    assert not cost.needs_plain_step


def test_odds_rise_with_acceptance_fall_with_rejection_and_fade_back() -> None:
    state = SpeculationState()
    assert state.accept_odds == 0.5
    state.record(accepted=7, rejected=False)
    assert state.accept_odds == pytest.approx(8 / 9)
    failing = SpeculationState()
    for _ in range(3):
        failing.record(accepted=0, rejected=True)
    assert failing.accept_odds == pytest.approx(1 / 5)
    for _ in range(200):
        failing.sit_out()
    assert failing.accept_odds == pytest.approx(0.5, abs=0.01)


def test_the_threshold_prunes_the_draft_tree_by_reach() -> None:
    index = NgramIndex(NgramConfig())
    passage = list(range(100, 140))
    index.add(passage, 0)
    context = passage[:10]
    # Reach of depth d is odds**d: with odds 0.8 and threshold 0.4, four drafts (0.8**4 = 0.41).
    assert index.propose(context, 8, 18, odds=0.8, min_reach=0.4).tokens == passage[9:14]
    assert len(index.propose(context, 8, 18, odds=0.3, min_reach=0.4)) == 1
    prob = NgramIndex(NgramConfig(match_type="PROB"))
    prob.add(passage, 0)
    assert prob.propose(context, 8, 18, odds=0.8, min_reach=0.4).tokens == passage[9:14]
