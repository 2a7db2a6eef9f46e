"""The scheduler over the fake executor: plain generation, stops, the control commands that read
the scheduler's parts, and the fake's own check that the KV it reads is the KV it wrote."""

from __future__ import annotations

import pytest
import torch

from radixserve.protocol.messages import (
    ControlRequest,
    ControlResult,
    GenerateRequest,
    ReqOutput,
    SchedulerInput,
    SchedulerOutput,
    ShutdownRequest,
)
from radixserve.protocol.sampling_params import SamplingParams
from radixserve.scheduler.event_loop import run_event_loop
from tests.scheduler.fake_executor import (
    FakeExecutor,
    Results,
    expected_output,
    greedy,
    make_scheduler,
    next_token,
    run_until_idle,
    submit,
)

VOCAB = 1024


def test_greedy_outputs_follow_the_fake_model() -> None:
    executor = FakeExecutor(vocab_size=VOCAB)
    scheduler = make_scheduler(executor)
    results = Results()
    prompts = {"a": [1, 2, 3], "b": [5, 6, 7, 8, 9], "c": [3, 1]}
    for rid, prompt in prompts.items():
        submit(scheduler, results, rid, prompt, 7)
    run_until_idle(scheduler, results)
    for rid, prompt in prompts.items():
        assert results.tokens[rid] == expected_output(prompt, 7, VOCAB)
        assert results.finish[rid].type == "length"
    assert [b.extend_lens for b in executor.prefills] == [[3, 5, 2]]
    assert [len(b.extend_lens) for b in executor.decodes] == [3] * 6
    # Going idle gives the executor its chance to free scratch memory, once.
    assert executor.idle_calls == 1
    scheduler.check_kv_invariant()


def test_an_eos_token_stops_the_request() -> None:
    prompt = [4, 5, 6]
    free_run = expected_output(prompt, 10, VOCAB)
    eos = free_run[3]
    assert eos not in free_run[:3]
    scheduler = make_scheduler(FakeExecutor(vocab_size=VOCAB, eos_token_ids=[eos]))
    results = Results()
    submit(scheduler, results, "stops", prompt, 10)
    submit(scheduler, results, "ignores", prompt, 10, ignore_eos=True)
    run_until_idle(scheduler, results)
    assert results.tokens["stops"] == free_run[:4]
    assert results.finish["stops"].type == "stop" and results.finish["stops"].matched == eos
    assert results.tokens["ignores"] == free_run
    scheduler.check_kv_invariant()


def test_control_commands_read_the_scheduler_through_its_managers() -> None:
    scheduler = make_scheduler(FakeExecutor(vocab_size=VOCAB), max_running_requests=4)
    results = Results()
    submit(scheduler, results, "a", [1, 2, 3], 5)
    results.take(scheduler.step())
    stats = scheduler.handle(ControlRequest("s", "get_stats"))[-1]
    assert isinstance(stats, ControlResult) and stats.ok, stats
    assert stats.payload["num_running_reqs"] == 1 and stats.payload["num_waiting_reqs"] == 0
    assert stats.payload["new_token_ratio"] == scheduler.decode.new_token_ratio
    assert stats.payload["attention_backend"] == "fake"
    assert stats.payload["kv_invariant"] == "not checked: busy"
    state = scheduler.handle(ControlRequest("g", "get_internal_state"))[-1]
    assert isinstance(state, ControlResult) and state.payload["max_running_requests"] == 4
    # Out of range (the request-slot pool was sized at startup): refused, nothing changes.
    refused = scheduler.handle(ControlRequest("x", "set_internal_state", {"max_running_requests": 9}))[-1]
    assert isinstance(refused, ControlResult) and not refused.ok and scheduler.prefill.max_running == 4
    # The KV self-check waits for idle, then answers.
    assert scheduler.handle(ControlRequest("k", "check_kv_invariant")) == []
    run_until_idle(scheduler, results)
    assert [(c.rid, c.ok) for c in results.controls] == [("k", True)]
    assert scheduler.controls.idle_waiters == []
    assert scheduler.flush_cache()
    scheduler.check_kv_invariant()


def test_the_fake_executor_notices_a_corrupt_kv_table() -> None:
    scheduler = make_scheduler(FakeExecutor(vocab_size=VOCAB))
    results = Results()
    submit(scheduler, results, "a", [1, 2, 3, 4], 5)
    submit(scheduler, results, "b", [9, 8, 7, 6], 5)
    results.take(scheduler.step())
    a, b = scheduler.queues.running
    table = scheduler.req_to_token_pool.req_to_token
    assert a.req_pool_idx is not None and b.req_pool_idx is not None
    # Point a's position 1 at b's slot for position 2.
    table[a.req_pool_idx, 1] = table[b.req_pool_idx, 2]
    with pytest.raises(AssertionError, match="holds position 2, expected 1"):
        scheduler.step()


def test_the_fake_model_reads_the_whole_context() -> None:
    """Two contexts that differ in one early token predict different tokens."""
    assert next_token([1, 2, 3], VOCAB) != next_token([1, 5, 3], VOCAB)
    executor = FakeExecutor(vocab_size=VOCAB)
    with pytest.raises(TypeError):
        executor.embed(None)  # type: ignore[arg-type]
    assert executor.info.dtype == torch.float32 and executor.info.device.type == "cpu"
    assert executor.info.config.architecture == "LlamaForCausalLM"


def test_the_event_loop_stamps_requests_an_idle_scheduler_took_at_once() -> None:
    """Requests taken while idle share one receipt time, sent with their first output (for the
    request trace); one taken while the scheduler is busy has its own, marked busy."""
    scheduler = make_scheduler(FakeExecutor(vocab_size=VOCAB))
    inbox: list[list[SchedulerInput]] = [
        [
            GenerateRequest("a", [1, 2, 3], SamplingParams.from_dict(greedy(3))),
            GenerateRequest("b", [4, 5], SamplingParams.from_dict(greedy(3))),
        ],
        [GenerateRequest("c", [6, 7], SamplingParams.from_dict(greedy(2)))],  # arrives while a and b run
        [],
        [],
        [],
        [],
        [ShutdownRequest()],
    ]
    emitted: list[SchedulerOutput] = []

    def receive(block: bool) -> list[SchedulerInput]:
        return inbox.pop(0)

    run_event_loop(scheduler, receive, emitted.extend)
    first: dict[str, tuple[float | None, bool]] = {}
    for out in emitted:
        if isinstance(out, ReqOutput) and out.rid not in first:
            first[out.rid] = (out.received_at, out.received_idle)
            assert out.first_output_at is not None and out.received_at is not None
            assert out.first_output_at >= out.received_at
        elif isinstance(out, ReqOutput):
            assert out.received_at is None and out.first_output_at is None  # the first output's only
    assert first["a"][0] is not None and first["a"] == first["b"] and first["a"][1]
    received_c, idle_c = first["c"]
    assert received_c is not None and received_c > first["a"][0] and not idle_c
    scheduler.check_kv_invariant()


def test_the_scheduler_times_itself_before_each_plain_decode_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the scheduler tells its HostTimeLine (get_stats' decode_host_time): each decode
    step's rows, and None for a prefill, in the order the executor ran them."""
    executor = FakeExecutor(vocab_size=VOCAB)
    scheduler = make_scheduler(executor)
    told: list[int | None] = []
    line = scheduler.stats.decode_host_time
    original = line.forward_started

    def forward_started(now: float, decode_rows: int | None) -> None:
        told.append(decode_rows)
        original(now, decode_rows)

    monkeypatch.setattr(line, "forward_started", forward_started)
    results = Results()
    for rid, length in (("a", 3), ("b", 6), ("c", 9)):
        submit(scheduler, results, rid, [1, 2, 3, 4], length)
    run_until_idle(scheduler, results)
    assert told == [None if b.is_prefill else len(b.extend_lens) for b in executor.batches]
    assert told[0] is None and len(set(told[1:])) == 3  # three batch sizes as requests finish
    stats = scheduler.handle(ControlRequest("s", "get_stats"))[-1]
    assert isinstance(stats, ControlResult)
    host = stats.payload["decode_host_time"]
    # Back to back, the fake's steps come well within IDLE_GAP_S of each other; a step after a
    # pause of the test process (a garbage collection) would be left out, so not all are required.
    assert 0 < host["steps"] <= len(executor.decodes)
    scheduler.check_kv_invariant()


def test_the_scheduler_takes_sampling_params_as_they_come(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request's sampling parameters are checked once, where the request is made: the scheduler
    never parses them again (and clips its own copy of the output budget)."""
    params = SamplingParams.from_dict(greedy(5))
    message = GenerateRequest("once", [1, 2, 3], params)

    def parsed_again(*_: object) -> SamplingParams:
        raise AssertionError("SamplingParams.from_dict ran in the scheduler")

    monkeypatch.setattr(SamplingParams, "from_dict", parsed_again)
    scheduler = make_scheduler(FakeExecutor(vocab_size=VOCAB, context_len=6))
    results = Results()
    results.take(scheduler.handle(message))
    run_until_idle(scheduler, results)
    assert len(results.tokens["once"]) == 3  # the context holds 3 more tokens
    assert params.max_new_tokens == 5  # the caller's object is not the one clipped
