"""The adaptive gate: the cost fit, the reach threshold it gives, and the per-request odds, on
synthetic timings (no clock is read)."""

from __future__ import annotations

import pytest

from radixserve.scheduler.request import SpeculationState
from radixserve.scheduler.speculative.cost import (
    EXPLORE_INTERVAL,
    INITIAL_REACH_THRESHOLD,
    PLAIN_STEP_INTERVAL,
    StepCost,
)
from radixserve.scheduler.speculative.ngram import NgramConfig, NgramIndex


def _fed(
    plain: float, intercept: float, slope: float, sizes: list[int], batch_slope: float = 0.0
) -> StepCost:
    """A cost fed plain decode steps (plain + batch_slope * (B - 1) seconds for B requests, B the
    verify sizes less one) and verify steps of the given sizes (intercept + slope * size)."""
    cost = StepCost()
    for n in sizes:
        cost.observe(1, plain, plain=True)
        cost.observe(n - 1, plain + batch_slope * (n - 2), plain=True)
        cost.observe(n, intercept + slope * n, plain=False)
    return cost


def test_the_verify_fit_prices_a_draft_and_gates_a_step() -> None:
    # An AVX2-like machine: decode 16.6 ms a token; a verify step 20 ms plus 6.6 ms a token.
    cost = _fed(0.0166, 0.020, 0.0066, [2, 8, 4, 3, 8])
    fitted = cost.verify.fit()
    assert fitted is not None
    assert fitted[0] == pytest.approx(0.020) and fitted[1] == pytest.approx(0.0066)
    assert cost.reach_threshold(1) == pytest.approx(0.0066 / 0.0166)
    # One stream, three drafts expected to give 2.7 tokens: 3.7 tokens for 46.4 ms beats 16.6 ms each.
    assert cost.worth_verifying(1, 3, 2.7)
    # One draft at even odds: 1.5 tokens for 33.2 ms does not.
    assert not cost.worth_verifying(1, 1, 0.5)
    # An AMX-like machine: drafts are nearly free, anything plausible is worth a try.
    cheap = _fed(0.0166, 0.017, 0.0002, [2, 8, 4])
    assert cheap.reach_threshold(1) < 0.02 and cheap.worth_verifying(1, 1, 0.3)


def test_a_batch_that_decodes_cheaply_per_token_drafts_only_near_certainties() -> None:
    # Plain steps cost 10 ms plus 6.6 ms per request: eight requests decode at 7.85 ms a token.
    cost = _fed(0.0166, 0.020, 0.0066, [2, 9, 4, 6], batch_slope=0.0066)
    assert cost.reach_threshold(8) == pytest.approx(0.0066 / ((0.01 + 8 * 0.0066) / 8))
    # Eight requests, eight drafts all but certain: 16 tokens for 125.6 ms vs 8 * 7.85 each.
    assert not cost.worth_verifying(8, 8, 7.2)


def test_until_both_costs_are_measured_drafts_are_short_and_steps_verify() -> None:
    assert StepCost().reach_threshold(1) == INITIAL_REACH_THRESHOLD
    same_size = _fed(0.0166, 0.02, 0.005, [2, 2, 2])
    assert same_size.reach_threshold(1) == INITIAL_REACH_THRESHOLD
    assert same_size.worth_verifying(1, 1, 0.1)


def test_plain_and_verify_steps_are_each_asked_for_now_and_then() -> None:
    cost = StepCost()
    for _ in range(PLAIN_STEP_INTERVAL - 1):
        cost.observe(8, 0.05, plain=False)
    assert not cost.needs_plain_step
    cost.observe(8, 0.05, plain=False)
    assert cost.needs_plain_step
    cost.observe(1, 0.02, plain=True)
    assert not cost.needs_plain_step
    gated = _fed(0.0166, 0.020, 0.0066, [2, 8, 4])
    assert not gated.worth_verifying(1, 1, 0.1)
    for _ in range(EXPLORE_INTERVAL):
        gated.observe(1, 0.0166, plain=True)
    assert gated.worth_verifying(1, 1, 0.1)


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


def test_shadow_drafts_count_as_a_verify_step_would_once_one_token_follows() -> None:
    """A plain step's emitted token tells whether the drafts offered for it would have held."""
    state = SpeculationState()
    for _ in range(3):
        state.record(accepted=0, rejected=True)
    low = state.accept_odds
    output = [5, 6]
    for token in range(7, 17):  # the text turns copyable: every offered first draft is emitted
        state.offer_shadow(frozenset({token, 99}), len(output))
        output.append(token)
        state.settle_shadow(output)
    assert state.accept_odds == pytest.approx(11 / 15) and low == pytest.approx(1 / 5)
    state.offer_shadow(frozenset({1}), len(output))
    output.append(2)  # a miss counts as a rejection
    before = state.rejected
    state.settle_shadow(output)
    assert state.rejected == before + 1
    # Anything but exactly one token later (a verify step, a retraction) drops the shadow.
    state.offer_shadow(frozenset({3}), len(output))
    output += [3, 4]
    counts = (state.accepted, state.rejected)
    state.settle_shadow(output)
    assert (state.accepted, state.rejected) == counts and not state.shadow


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
