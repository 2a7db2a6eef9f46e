"""Retraction and new_token_ratio, on a KV pool too small for every running request (fake executor).

A low --schedule-conservativeness makes admission optimistic: more requests are admitted than the
pool can carry to the end, so decoding runs out of KV and the scheduler retracts.
"""

from __future__ import annotations

from radixserve.protocol.messages import ControlRequest, ControlResult
from radixserve.scheduler.decode import (
    INIT_NEW_TOKEN_RATIO,
    MIN_NEW_TOKEN_RATIO_FACTOR,
    NEW_TOKEN_RATIO_DECAY_STEPS,
    RETRACT_HEADROOM_STEPS,
    RETRACT_RATIO_STEP,
)
from radixserve.scheduler.request import Req
from radixserve.scheduler.scheduler import Scheduler
from tests.scheduler.fake_executor import (
    FakeExecutor,
    Results,
    expected_output,
    make_scheduler,
    run_until_idle,
    submit,
)
from tests.scheduler.probes import ReqView, StepProbe, probe_steps

VOCAB = 1024
CONSERVATIVENESS = 0.05
MAX_NEW = 16
# Two requests start first and decode a few steps; three more arrive later with fewer outputs.
FIRST = {"a0": 8, "a1": 7}
LATER = {"b0": 11, "b1": 9, "b2": 10}
HEAD_START_STEPS = 4
SMALL_POOL = 64


def _prompt(rid: str, length: int) -> list[int]:
    base = 100 * (list(FIRST) + list(LATER)).index(rid) + 1
    return list(range(base, base + length))


def _ratio_constants(conservativeness: float) -> tuple[float, float, float]:
    init = min(1.0, INIT_NEW_TOKEN_RATIO * conservativeness)
    floor = init * MIN_NEW_TOKEN_RATIO_FACTOR
    return init, floor, (init - floor) / NEW_TOKEN_RATIO_DECAY_STEPS


def _retraction_estimate(kept: list[ReqView]) -> float:
    decoded = sum(v.outputs for v in kept)
    budget = sum(v.max_new_tokens for v in kept)
    return (decoded + RETRACT_HEADROOM_STEPS * len(kept)) / max(budget, 1)


def _expected_ratio(probe: StepProbe, decay: float, floor: float) -> float:
    if probe.retracted:
        estimate = _retraction_estimate(probe.running_after)
        return min(1.0, max(estimate, probe.ratio_before + RETRACT_RATIO_STEP))
    return max(probe.ratio_before - decay, floor)


def _run_scenario(pool: int) -> tuple[Scheduler, FakeExecutor, Results, list[StepProbe], dict[str, Req]]:
    executor = FakeExecutor(vocab_size=VOCAB, max_total_tokens=pool)
    scheduler = make_scheduler(executor, schedule_conservativeness=CONSERVATIVENESS)
    probes = probe_steps(scheduler)
    results = Results()
    for rid, length in FIRST.items():
        submit(scheduler, results, rid, _prompt(rid, length), MAX_NEW)
    for _ in range(HEAD_START_STEPS):
        results.take(scheduler.step())
    for rid, length in LATER.items():
        submit(scheduler, results, rid, _prompt(rid, length), MAX_NEW)
    reqs = dict(scheduler.reqs)
    run_until_idle(scheduler, results)
    return scheduler, executor, results, probes, reqs


def test_retraction_sends_back_fewest_outputs_first_and_readmits_them() -> None:
    scheduler, executor, results, probes, reqs = _run_scenario(SMALL_POOL)
    retractions = [p for p in probes if p.retracted]
    assert retractions, "the scenario must run out of KV"
    first = retractions[0]
    kept = {v.rid for v in first.running_after}
    # Retracted requests join the end of the queue in the order they were chosen.
    victims = first.waiting_after[len(first.waiting_after) - first.retracted :]
    assert {v.rid for v in victims} == {v.rid for v in first.running_before} - kept
    # Fewest output tokens first; between equal counts the longest prompt first.
    ranked = sorted(first.running_before, key=lambda v: (v.outputs, -v.prompt_len))
    assert [v.rid for v in victims] == [v.rid for v in ranked[: first.retracted]]
    # The scenario exercises both rules: later arrivals have fewer outputs, and ties are broken.
    assert [v.rid for v in victims] == ["b0", "b1", "a0"]
    assert kept == {"a1"}

    # Each one comes back: re-admitted by a later prefill, it finishes like an unconstrained run.
    for rid in (v.rid for v in victims):
        assert reqs[rid].retractions >= 1
    assert scheduler.stats.retracted_reqs == sum(r.retractions for r in reqs.values())
    readmitted = [b for b in executor.prefills if b.prefix_lens and max(b.prefix_lens) > 0]
    assert readmitted, "a retracted request resumes from its KV kept in the radix cache"

    _, _, reference, reference_probes, _ = _run_scenario(pool=4096)
    assert not any(p.retracted for p in reference_probes)
    assert results.tokens == reference.tokens
    for rid, length in {**FIRST, **LATER}.items():
        assert results.tokens[rid] == expected_output(_prompt(rid, length), MAX_NEW, VOCAB)
        assert results.finish[rid].type == "length"
    assert scheduler.is_idle
    scheduler.check_kv_invariant()


def test_new_token_ratio_decays_per_decode_step_and_jumps_on_retraction() -> None:
    scheduler, _, _, probes, _ = _run_scenario(SMALL_POOL)
    init, floor, decay = _ratio_constants(CONSERVATIVENESS)
    assert (scheduler.decode.init_new_token_ratio, scheduler.decode.min_new_token_ratio) == (init, floor)
    assert scheduler.decode.new_token_ratio_decay == decay
    assert probes[0].ratio_before == init
    for probe in probes:
        if probe.kind == "decode":
            assert probe.ratio_after == _expected_ratio(probe, decay, floor), probe
        else:
            assert probe.ratio_after == probe.ratio_before, probe
    decodes = [p for p in probes if p.kind == "decode"]
    assert any(p.retracted for p in decodes) and any(not p.retracted for p in decodes)
    scheduler.check_kv_invariant()


def test_retraction_raises_new_token_ratio_by_at_least_a_step() -> None:
    """When the running requests' estimate is below the old ratio plus a step, the step wins; later,
    with fewer requests left, the estimate does."""
    executor = FakeExecutor(vocab_size=VOCAB, max_total_tokens=160)
    scheduler = make_scheduler(executor, schedule_conservativeness=0.005)
    probes = probe_steps(scheduler)
    results = Results()
    prompts = {f"r{i}": list(range(100 * i + 1, 100 * i + 9 + i)) for i in range(3)}
    for rid, prompt in prompts.items():
        submit(scheduler, results, rid, prompt, 100)
    while scheduler.queues.waiting:
        results.take(scheduler.step())
    # Everything is admitted, so the ratio no longer changes admission: start it high.
    scheduler.decode.new_token_ratio = 0.7
    run_until_idle(scheduler, results)

    _, floor, decay = _ratio_constants(0.005)
    jumps = [p for p in probes if p.retracted]
    assert jumps
    first = jumps[0]
    assert _retraction_estimate(first.running_after) < first.ratio_before + RETRACT_RATIO_STEP < 1.0
    assert first.ratio_after == first.ratio_before + RETRACT_RATIO_STEP
    assert any(p.ratio_after == _retraction_estimate(p.running_after) < 1.0 for p in jumps[1:])
    for probe in probes:
        if probe.kind == "decode":
            assert probe.ratio_after == _expected_ratio(probe, decay, floor), probe
    for rid, prompt in prompts.items():
        assert results.tokens[rid] == expected_output(prompt, 100, VOCAB)
    scheduler.check_kv_invariant()


def test_new_token_ratio_floor_and_reset_through_internal_state() -> None:
    scheduler = make_scheduler(FakeExecutor(vocab_size=VOCAB), schedule_conservativeness=0.5)
    init, floor, decay = _ratio_constants(0.5)
    results = Results()
    submit(scheduler, results, "r", [1, 2, 3], 12)
    results.take(scheduler.step())  # the prefill leaves the ratio alone
    assert scheduler.decode.new_token_ratio == init
    expected = init
    for _ in range(5):
        results.take(scheduler.step())
        expected = max(expected - decay, floor)
        assert scheduler.decode.new_token_ratio == expected
    scheduler.decode.new_token_ratio = floor + decay / 2
    results.take(scheduler.step())
    assert scheduler.decode.new_token_ratio == floor

    # /set_internal_state: a new conservativeness starts the ratio over from its new initial value.
    answer = scheduler.handle(ControlRequest("c", "set_internal_state", {"schedule_conservativeness": 2.0}))
    assert isinstance(answer[-1], ControlResult) and answer[-1].ok, answer
    init2, floor2, decay2 = _ratio_constants(2.0)
    assert init2 == 1.0
    assert scheduler.decode.new_token_ratio == scheduler.decode.init_new_token_ratio == init2
    assert (scheduler.decode.min_new_token_ratio, scheduler.decode.new_token_ratio_decay) == (floor2, decay2)
    run_until_idle(scheduler, results)
    assert results.tokens["r"] == expected_output([1, 2, 3], 12, VOCAB)
    scheduler.check_kv_invariant()
