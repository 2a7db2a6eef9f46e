"""How the scheduler forms prefill batches (fake executor): chunked prefill, mixed prefill+decode
batches, and the --max-running-requests / --max-prefill-tokens budgets."""

from __future__ import annotations

from typing import Any

import pytest

from radixserve.config.server_args import DEFAULT_CHUNKED_PREFILL_SIZE, chunked_prefill_tokens
from radixserve.protocol.messages import ControlRequest, ControlResult
from tests.scheduler.fake_executor import (
    FakeExecutor,
    Results,
    expected_output,
    make_scheduler,
    run_until_idle,
    submit,
)
from tests.scheduler.probes import probe_steps

VOCAB = 1024


def _prompt(first: int, length: int) -> list[int]:
    return list(range(first, first + length))


def _run(prompts: dict[str, list[int]], max_new: int, **server_args: Any) -> tuple[Results, FakeExecutor]:
    executor = FakeExecutor(vocab_size=VOCAB, max_total_tokens=server_args.pop("pool", 512))
    scheduler = make_scheduler(executor, **server_args)
    results = Results()
    for rid, prompt in prompts.items():
        submit(scheduler, results, rid, prompt, max_new)
    run_until_idle(scheduler, results)
    scheduler.check_kv_invariant()
    return results, executor


# ---------------------------------------------------------------- chunked prefill


def test_the_default_chunk_is_the_devices_and_minus_one_turns_chunking_off() -> None:
    """No --chunked-prefill-size: the scheduler takes its device's default (the fake executor's
    device is the CPU), and a 1,200-token prompt runs in 512-token chunks; -1 (or 0, as SGLang
    takes it) runs it whole."""
    prompt = _prompt(1, 1200)
    executor = FakeExecutor(vocab_size=2048, max_total_tokens=2048, context_len=2048)
    scheduler = make_scheduler(executor)
    assert scheduler.args.chunked_prefill_size == DEFAULT_CHUNKED_PREFILL_SIZE["cpu"] == 512
    results = Results()
    submit(scheduler, results, "long", prompt, 2)
    run_until_idle(scheduler, results)
    assert [b.extend_lens for b in executor.prefills] == [[512], [512], [176]]
    scheduler.check_kv_invariant()
    for off in (-1, 0):
        executor = FakeExecutor(vocab_size=2048, max_total_tokens=2048, context_len=2048)
        scheduler = make_scheduler(executor, chunked_prefill_size=off)
        assert scheduler.args.chunked_prefill_size is None
        submit(scheduler, results, f"whole{off}", prompt, 2)
        run_until_idle(scheduler, results)
        assert [b.extend_lens for b in executor.prefills] == [[1200]]
        scheduler.check_kv_invariant()
    assert chunked_prefill_tokens(None, "cuda") == 2048


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_long_prompt_is_prefilled_in_chunks_of_the_chunk_size(page_size: int) -> None:
    chunk, prompt = 16, _prompt(1, 50)
    executor = FakeExecutor(vocab_size=VOCAB, max_total_tokens=256)
    scheduler = make_scheduler(executor, chunked_prefill_size=chunk, page_size=page_size)
    results = Results()
    submit(scheduler, results, "long", prompt, 6)
    results.take(scheduler.step())
    # Between chunks the request holds KV but is not running: it has nothing to decode yet.
    assert scheduler.queues.chunked_req is not None and scheduler.queues.chunked_req.rid == "long"
    assert scheduler.queues.running == [] and scheduler.queues.waiting == []
    run_until_idle(scheduler, results)

    prefills = executor.prefills
    assert [b.extend_lens for b in prefills] == [[16], [16], [16], [2]]
    assert [b.prefix_lens for b in prefills] == [[0], [16], [32], [48]]
    # Only the last chunk reaches the end of the prompt and samples.
    assert [b.num_sampled for b in prefills] == [0, 0, 0, 1]
    assert [t for b in prefills for t in b.segments[0]] == prompt
    assert scheduler.queues.chunked_req is None

    unchunked, unchunked_executor = _run({"long": prompt}, 6, chunked_prefill_size=-1, page_size=page_size)
    assert [b.extend_lens for b in unchunked_executor.prefills] == [[50]]
    assert results.tokens == unchunked.tokens
    assert results.tokens["long"] == expected_output(prompt, 6, VOCAB)
    scheduler.check_kv_invariant()


def test_the_last_chunk_shares_its_batch_with_a_short_request() -> None:
    """Other requests wait while chunks use the whole chunk budget; the last chunk leaves room."""
    prompts = {"long": _prompt(1, 50), "short": _prompt(200, 5)}
    results, executor = _run(prompts, 4, chunked_prefill_size=16)
    assert [b.extend_lens for b in executor.prefills] == [[16], [16], [16], [2, 5]]
    assert executor.prefills[-1].segments[1] == prompts["short"]
    reference, _ = _run(prompts, 4, chunked_prefill_size=-1)
    assert results.tokens == reference.tokens


# ---------------------------------------------------------------- mixed prefill + decode


def _mixed_scenario(enable_mixed_chunk: bool) -> tuple[Results, FakeExecutor, dict[str, list[int]]]:
    """a and b run; c arrives after one decode step. Stops after c's prefill."""
    prompts = {"a": _prompt(1, 6), "b": _prompt(100, 5), "c": _prompt(200, 7)}
    executor = FakeExecutor(vocab_size=VOCAB)
    scheduler = make_scheduler(executor, enable_mixed_chunk=enable_mixed_chunk)
    results = Results()
    submit(scheduler, results, "a", prompts["a"], 8)
    submit(scheduler, results, "b", prompts["b"], 8)
    results.take(scheduler.step())  # prefill a and b
    results.take(scheduler.step())  # one decode step
    submit(scheduler, results, "c", prompts["c"], 8)
    results.take(scheduler.step())  # c's prefill
    assert executor.batches[-1].is_prefill
    run_until_idle(scheduler, results)
    scheduler.check_kv_invariant()
    return results, executor, prompts


def test_mixed_chunk_running_requests_ride_along_as_one_token_extends() -> None:
    results, executor, prompts = _mixed_scenario(enable_mixed_chunk=True)
    a, b, c = prompts["a"], prompts["b"], prompts["c"]
    mixed = executor.batches[2]
    # The new request first, then every running request computing its last output token.
    assert mixed.extend_lens == [7, 1, 1]
    # a and b hold the KV of their prompt and of their first output.
    assert mixed.prefix_lens == [0, len(a) + 1, len(b) + 1]
    assert mixed.segments == [c, [results.tokens["a"][1]], [results.tokens["b"][1]]]
    assert mixed.num_sampled == 3

    plain_results, plain_executor, _ = _mixed_scenario(enable_mixed_chunk=False)
    assert plain_executor.batches[2].extend_lens == [7]
    assert results.tokens == plain_results.tokens
    for rid, prompt in prompts.items():
        assert results.tokens[rid] == expected_output(prompt, 8, VOCAB)


def test_mixed_chunk_leaves_room_in_the_chunk_for_the_riders() -> None:
    executor = FakeExecutor(vocab_size=VOCAB)
    scheduler = make_scheduler(executor, enable_mixed_chunk=True, chunked_prefill_size=16)
    results = Results()
    submit(scheduler, results, "a", _prompt(1, 4), 20)
    submit(scheduler, results, "b", _prompt(100, 4), 20)
    results.take(scheduler.step())
    submit(scheduler, results, "long", _prompt(200, 40), 4)
    run_until_idle(scheduler, results)
    # Each chunk gives up one token of the chunk budget per running request riding along.
    assert [b.extend_lens for b in executor.prefills] == [[4, 4], [14, 1, 1], [14, 1, 1], [12, 1, 1]]
    assert results.tokens["long"] == expected_output(_prompt(200, 40), 4, VOCAB)
    scheduler.check_kv_invariant()


# ---------------------------------------------------------------- budgets


def test_max_running_requests_caps_the_running_batch() -> None:
    executor = FakeExecutor(vocab_size=VOCAB)
    scheduler = make_scheduler(executor, max_running_requests=2)
    probes = probe_steps(scheduler)
    results = Results()
    prompts = {f"r{i}": _prompt(10 * i + 1, 4 + i) for i in range(5)}
    for i, (rid, prompt) in enumerate(prompts.items()):
        submit(scheduler, results, rid, prompt, 3 + i)
    run_until_idle(scheduler, results)

    batches = iter(executor.batches)
    for probe in probes:
        if probe.kind == "none":
            continue
        batch = next(batches)
        if probe.kind == "prefill":
            assert len(probe.running_before) + len(batch.extend_lens) <= 2
        else:
            assert len(batch.extend_lens) <= 2
    assert max(len(b.extend_lens) for b in executor.decodes) == 2
    # Two running requests and the spare slot for a chunked prefill.
    assert scheduler.req_to_token_pool.size == 3
    assert sorted(results.finish) == sorted(prompts)
    scheduler.check_kv_invariant()


def test_max_running_requests_changes_at_run_time() -> None:
    executor = FakeExecutor(vocab_size=VOCAB)
    scheduler = make_scheduler(executor, max_running_requests=3)
    results = Results()
    answer = scheduler.handle(ControlRequest("c", "set_internal_state", {"max_running_requests": 1}))
    assert isinstance(answer[-1], ControlResult) and answer[-1].ok, answer
    assert scheduler.prefill.max_running == scheduler.prefill.max_running == 1
    for i in range(3):
        submit(scheduler, results, f"r{i}", _prompt(10 * i + 1, 4), 3)
    run_until_idle(scheduler, results)
    assert all(len(b.extend_lens) == 1 for b in executor.batches)
    assert len(results.finish) == 3
    scheduler.check_kv_invariant()


def test_max_prefill_tokens_bounds_each_prefill_batch() -> None:
    prompts = {f"r{i}": _prompt(10 * i + 1, 8) for i in range(5)}
    results, executor = _run(prompts, 2, max_prefill_tokens=20)
    assert [b.extend_lens for b in executor.prefills] == [[8, 8], [8, 8], [8]]
    assert all(b.num_tokens <= 20 for b in executor.prefills)
    for rid, prompt in prompts.items():
        assert results.tokens[rid] == expected_output(prompt, 2, VOCAB)


def test_a_prompt_over_max_prefill_tokens_still_runs_alone() -> None:
    prompts = {"big": _prompt(1, 30), "small": _prompt(100, 4)}
    results, executor = _run(prompts, 2, max_prefill_tokens=20, chunked_prefill_size=-1)
    assert [b.extend_lens for b in executor.prefills] == [[30], [4]]
    assert results.tokens["big"] == expected_output(prompts["big"], 2, VOCAB)
