"""Aborting requests in every state the scheduler holds them in (fake executor): none may leak a KV
slot or a request slot, and the requests left keep running unharmed."""

from __future__ import annotations

import pytest

from radixserve.protocol.messages import AbortRequest
from radixserve.scheduler.scheduler import Scheduler
from tests.scheduler.fake_executor import (
    FakeExecutor,
    Results,
    check_kv_accounting,
    expected_output,
    make_scheduler,
    run_until_idle,
    submit,
)

VOCAB = 1024
LONG = list(range(1, 51))


def _abort(scheduler: Scheduler, results: Results, rid: str | None, abort_all: bool = False) -> None:
    results.take(scheduler.handle(AbortRequest(rid, abort_all=abort_all)))
    check_kv_accounting(scheduler)


def _assert_all_free(scheduler: Scheduler) -> None:
    """Idle: every KV slot free or evictable, no lock held, every request slot free."""
    assert scheduler.is_idle and not scheduler.reqs
    cache, allocator = scheduler.tree_cache, scheduler.allocator
    assert allocator.available_size() + cache.evictable_size() == allocator.total_slots
    assert cache.protected_size() == 0
    assert scheduler.req_to_token_pool.available_size() == scheduler.req_to_token_pool.size
    scheduler.check_kv_invariant()


def test_abort_a_waiting_request() -> None:
    scheduler = make_scheduler(FakeExecutor(vocab_size=VOCAB), max_running_requests=1)
    results = Results()
    submit(scheduler, results, "a", [1, 2, 3], 5)
    submit(scheduler, results, "b", [4, 5, 6], 5)
    results.take(scheduler.step())
    assert [r.rid for r in scheduler.queues.waiting] == ["b"]
    _abort(scheduler, results, "b")
    assert results.finish["b"].type == "abort" and results.tokens["b"] == []
    assert scheduler.queues.waiting == []
    run_until_idle(scheduler, results)
    assert results.tokens["a"] == expected_output([1, 2, 3], 5, VOCAB)
    assert scheduler.stats.aborted_reqs == 1
    _assert_all_free(scheduler)


@pytest.mark.parametrize("overlap", [False, True])
def test_abort_a_running_request(overlap: bool) -> None:
    executor = FakeExecutor(vocab_size=VOCAB)
    scheduler = make_scheduler(executor, enable_overlap_schedule=overlap)
    assert (scheduler.publisher is not None) == overlap
    results = Results()
    submit(scheduler, results, "a", [1, 2, 3], 20)
    submit(scheduler, results, "b", [7, 8, 9, 10], 6)
    for _ in range(4):
        results.take(scheduler.step())
    _abort(scheduler, results, "a")
    assert results.finish["a"].type == "abort"
    # It keeps the tokens it had; under the overlap schedule the last step's are published first.
    assert results.tokens["a"] == expected_output([1, 2, 3], 20, VOCAB)[: len(results.tokens["a"])]
    assert len(results.tokens["a"]) == 4
    assert [r.rid for r in scheduler.queues.running] == ["b"]
    run_until_idle(scheduler, results)
    assert results.tokens["b"] == expected_output([7, 8, 9, 10], 6, VOCAB)
    assert results.finish["b"].type == "length"
    # The aborted request's KV went into the radix cache, like a finished request's.
    assert scheduler.tree_cache.evictable_size() > 0
    _assert_all_free(scheduler)
    if scheduler.publisher is not None:
        scheduler.publisher.shutdown()


def test_abort_a_request_between_its_chunks() -> None:
    executor = FakeExecutor(vocab_size=VOCAB)
    scheduler = make_scheduler(executor, chunked_prefill_size=16)
    results = Results()
    submit(scheduler, results, "short", [900, 901], 8)
    results.take(scheduler.step())
    submit(scheduler, results, "long", LONG, 4)
    results.take(scheduler.step())
    results.take(scheduler.step())
    assert scheduler.queues.chunked_req is not None and scheduler.queues.chunked_req.kv_len == 32
    _abort(scheduler, results, "long")
    assert scheduler.queues.chunked_req is None
    assert results.finish["long"].type == "abort" and results.tokens["long"] == []
    run_until_idle(scheduler, results)
    assert results.tokens["short"] == expected_output([900, 901], 8, VOCAB)
    _assert_all_free(scheduler)

    # The chunks it computed stay cached: the same prompt again starts after them.
    seen = len(executor.batches)
    submit(scheduler, results, "again", LONG, 4)
    run_until_idle(scheduler, results)
    assert executor.batches[seen].prefix_lens == [32]
    assert results.tokens["again"] == expected_output(LONG, 4, VOCAB)
    _assert_all_free(scheduler)


def test_abort_all_in_every_state() -> None:
    executor = FakeExecutor(vocab_size=VOCAB)
    scheduler = make_scheduler(executor, chunked_prefill_size=16)
    results = Results()
    submit(scheduler, results, "running", [1, 2, 3, 4], 20)
    results.take(scheduler.step())
    # Only one request is prefilled in chunks at a time: the second long prompt waits.
    submit(scheduler, results, "chunked", LONG, 4)
    submit(scheduler, results, "waiting", list(range(100, 140)), 4)
    results.take(scheduler.step())
    assert [r.rid for r in scheduler.queues.running] == ["running"]
    assert scheduler.queues.chunked_req is not None and scheduler.queues.chunked_req.rid == "chunked"
    assert [r.rid for r in scheduler.queues.waiting] == ["waiting"]

    _abort(scheduler, results, None, abort_all=True)
    assert {rid: f.type for rid, f in results.finish.items()} == dict.fromkeys(
        ["running", "chunked", "waiting"], "abort"
    )
    assert scheduler.stats.aborted_reqs == 3
    _assert_all_free(scheduler)
    run_until_idle(scheduler, results)  # nothing left to do; the idle step checks the KV again
    _assert_all_free(scheduler)


def test_abort_of_an_unknown_or_finished_request_changes_nothing() -> None:
    scheduler = make_scheduler(FakeExecutor(vocab_size=VOCAB))
    results = Results()
    submit(scheduler, results, "a", [1, 2, 3], 2)
    run_until_idle(scheduler, results)
    assert scheduler.handle(AbortRequest("a")) == []
    assert scheduler.handle(AbortRequest("nobody")) == []
    assert results.finish["a"].type == "length"
    assert scheduler.stats.aborted_reqs == 0
    _assert_all_free(scheduler)


def test_abort_by_rid_prefix_takes_every_request_it_starts() -> None:
    """SGLang's rule: an abort names a rid prefix (the choices of one n > 1 request share theirs)."""
    scheduler = make_scheduler(FakeExecutor(vocab_size=VOCAB), max_running_requests=2)
    results = Results()
    for rid, prompt in [("job-1", [1, 2, 3]), ("job-2", [4, 5]), ("other", [6, 7]), ("job-3", [8])]:
        submit(scheduler, results, rid, prompt, 10)
    results.take(scheduler.step())  # two run, two wait
    assert {r.rid for r in scheduler.queues.running} == {"job-1", "job-2"}
    _abort(scheduler, results, "job-")
    assert {rid for rid, finish in results.finish.items() if finish.type == "abort"} == {
        "job-1",
        "job-2",
        "job-3",
    }
    _abort(scheduler, results, "")  # an empty rid names nothing
    run_until_idle(scheduler, results)
    assert results.tokens["other"] == expected_output([6, 7], 10, VOCAB)
    assert scheduler.stats.aborted_reqs == 3
    _assert_all_free(scheduler)
