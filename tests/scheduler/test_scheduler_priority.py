"""Request priorities (--enable-priority-scheduling), on a fake executor: admission by priority
within the policy, and preemption of running requests a waiting one outranks when KV is short
(through retraction, so every output stays exact and no KV slot leaks)."""

from __future__ import annotations

from typing import Any

from radixserve.protocol.messages import GenerateRequest
from radixserve.protocol.sampling_params import SamplingParams
from radixserve.scheduler.scheduler import Scheduler
from tests.scheduler.fake_executor import (
    FakeExecutor,
    Results,
    expected_output,
    greedy,
    make_scheduler,
    run_until_idle,
)

VOCAB = 1024
MAX_NEW = 16
SMALL_POOL = 64


def _prompt(index: int, length: int) -> list[int]:
    return list(range(100 * index + 1, 100 * index + 1 + length))


def _submit(
    scheduler: Scheduler, results: Results, rid: str, prompt: list[int], priority: int | None
) -> None:
    params = SamplingParams.from_dict(greedy(MAX_NEW))
    results.take(scheduler.handle(GenerateRequest(rid, prompt, params, priority=priority)))


def _admission_order(**server_args: Any) -> list[str]:
    """Submits four requests to an idle scheduler that admits one per step, and returns the order
    they were prefilled in."""
    executor = FakeExecutor(vocab_size=VOCAB)
    scheduler = make_scheduler(executor, max_running_requests=1, **server_args)
    results = Results()
    for index, (rid, priority) in enumerate([("a", None), ("b", 5), ("c", -3), ("d", 5)]):
        _submit(scheduler, results, rid, _prompt(index, 8), priority)
    order = []
    first_tokens = {rid: _prompt(i, 8)[0] for i, rid in enumerate("abcd")}
    run_until_idle(scheduler, results)
    for batch in executor.prefills:
        for segment in batch.segments:
            order += [rid for rid, token in first_tokens.items() if segment and segment[0] == token]
    scheduler.check_kv_invariant()
    return order


def test_admission_follows_priority_then_arrival() -> None:
    # Higher values first (SGLang's default); equal priorities keep their arrival order; no
    # priority counts as 0.
    assert _admission_order(enable_priority_scheduling=True) == ["b", "d", "a", "c"]
    assert _admission_order(enable_priority_scheduling=True, schedule_low_priority_values_first=True) == [
        "c",
        "a",
        "b",
        "d",
    ]
    # Without the flag priorities are ignored, as SGLang ignores them.
    assert _admission_order() == ["a", "b", "c", "d"]


def _preemption_run(pool: int, high_priority: int, **server_args: Any) -> tuple[Scheduler, Results, int]:
    """Two low-priority requests run; a third that outranks them arrives when the pool cannot hold
    it too. Returns the scheduler, the results, and the steps the third waited for its prefill."""
    executor = FakeExecutor(vocab_size=VOCAB, max_total_tokens=pool)
    scheduler = make_scheduler(executor, enable_priority_scheduling=True, **server_args)
    results = Results()
    _submit(scheduler, results, "low0", _prompt(0, 12), 0)
    _submit(scheduler, results, "low1", _prompt(1, 12), 0)
    for _ in range(3):
        results.take(scheduler.step())
    assert len(scheduler.queues.running) == 2
    _submit(scheduler, results, "high", _prompt(2, 20), high_priority)
    waited = 0
    while "high" not in [r.rid for r in scheduler.queues.running] and "high" not in results.finish:
        results.take(scheduler.step())
        waited += 1
    run_until_idle(scheduler, results)
    return scheduler, results, waited


def test_a_request_that_outranks_running_ones_preempts_them_and_outputs_stay_exact() -> None:
    scheduler, results, waited = _preemption_run(SMALL_POOL, high_priority=100)
    assert waited == 1, "the outranking request is prefilled at once, in the next step"
    assert scheduler.stats.retracted_reqs >= 1
    for rid, index, length in (("low0", 0, 12), ("low1", 1, 12), ("high", 2, 20)):
        assert results.tokens[rid] == expected_output(_prompt(index, length), MAX_NEW, VOCAB)
        assert results.finish[rid].type == "length"
    assert not scheduler.reqs  # every request finished and left
    assert scheduler.is_idle
    scheduler.check_kv_invariant()


def test_no_preemption_within_the_threshold_or_without_room_to_gain() -> None:
    # Outranking by no more than the threshold (10 by default) waits for KV like anyone else.
    scheduler, results, waited = _preemption_run(SMALL_POOL, high_priority=10)
    assert waited > 1
    assert scheduler.stats.retracted_reqs == 0
    assert results.tokens["high"] == expected_output(_prompt(2, 20), MAX_NEW, VOCAB)
    scheduler.check_kv_invariant()
    # A lower threshold lets the same request in at once.
    scheduler, _, waited = _preemption_run(
        SMALL_POOL, high_priority=10, priority_scheduling_preemption_threshold=5
    )
    assert waited == 1
    scheduler.check_kv_invariant()
