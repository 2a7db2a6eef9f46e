"""Micro-batched pipeline parallelism (scheduler/pipeline.py) over a fake executor whose stages
each keep a KV pool of their own: outputs equal one stage's, the stages are kept busy, and
retraction, chunking and aborts stay consistent while micro-batches are in flight."""

from __future__ import annotations

import random

import pytest

from radixserve.protocol.messages import ControlRequest, ControlResult, GenerateRequest, ReqOutput
from radixserve.protocol.sampling_params import SamplingParams
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


def prompts(count: int, seed: int) -> dict[str, list[int]]:
    """Prompts of 3 to 90 tokens, every third one sharing a 40-token prefix with the others."""
    rng = random.Random(seed)
    shared = [rng.randrange(VOCAB) for _ in range(40)]
    out = {}
    for i in range(count):
        own = [rng.randrange(VOCAB) for _ in range(rng.randrange(3, 50))]
        out[f"r{i}"] = shared + own if i % 3 == 0 else own
    return out


def serve_and_check(scheduler: Scheduler, all_prompts: dict[str, list[int]], max_new: int) -> None:
    """Submits every prompt at once, runs until idle, and checks each output against the fake
    model's and the KV invariant."""
    results = Results()
    for rid, prompt in all_prompts.items():
        submit(scheduler, results, rid, prompt, max_new)
    run_until_idle(scheduler, results)
    for rid, prompt in all_prompts.items():
        assert results.tokens[rid] == expected_output(prompt, max_new, VOCAB), rid
    scheduler.check_kv_invariant()


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("mixed", [False, True])
def test_micro_batches_give_one_stages_outputs_and_keep_every_stage_busy(stages: int, mixed: bool) -> None:
    executor = FakeExecutor(vocab_size=VOCAB, max_total_tokens=2048, stages=stages)
    scheduler = make_scheduler(executor, chunked_prefill_size=32, enable_mixed_chunk=mixed)
    assert scheduler.pipeline is not None and scheduler.publisher is None
    results = Results()
    max_new = {rid: 5 + i % 9 for i, rid in enumerate(prompts(12, 0))}
    for rid, prompt in prompts(12, 0).items():
        submit(scheduler, results, rid, prompt, max_new[rid])
    run_until_idle(scheduler, results)
    for rid, prompt in prompts(12, 0).items():
        assert results.tokens[rid] == expected_output(prompt, max_new[rid], VOCAB), rid
    # Every stage had a micro-batch at once, and decode micro-batches split the running requests.
    assert executor.most_in_flight == stages
    assert max(len(b.extend_lens) for b in executor.decodes) <= -(-12 // stages)
    (reply,) = scheduler.handle(ControlRequest("stats", "get_stats"))
    assert isinstance(reply, ControlResult) and reply.ok
    stats = reply.payload["pipeline"]
    assert stats["stages"] == stages and stats["ticks"] == executor.ticks
    assert 0 < stats["utilization"] <= 1
    scheduler.check_kv_invariant()


def test_requests_arriving_while_micro_batches_are_in_flight() -> None:
    executor = FakeExecutor(vocab_size=VOCAB, max_total_tokens=2048, stages=2)
    scheduler = make_scheduler(executor, chunked_prefill_size=16)
    results = Results()
    all_prompts = prompts(10, 1)
    for i, (rid, prompt) in enumerate(all_prompts.items()):
        submit(scheduler, results, rid, prompt, 12)
        for _ in range(i % 4):
            results.take(scheduler.step())
            check_kv_accounting(scheduler)
    run_until_idle(scheduler, results)
    for rid, prompt in all_prompts.items():
        assert results.tokens[rid] == expected_output(prompt, 12, VOCAB), rid
    scheduler.check_kv_invariant()


@pytest.mark.parametrize("stages", [2, 3])
def test_retraction_in_a_small_pool_keeps_outputs_exact(stages: int) -> None:
    executor = FakeExecutor(vocab_size=VOCAB, max_total_tokens=320, stages=stages)
    scheduler = make_scheduler(executor, chunked_prefill_size=64, schedule_conservativeness=0.05)
    all_prompts = {f"r{i}": [(7 * i + j) % VOCAB for j in range(20 + 3 * i)] for i in range(8)}
    serve_and_check(scheduler, all_prompts, 40)
    assert scheduler.stats.retracted_reqs > 0
    assert executor.most_in_flight == stages


def test_an_abort_drains_the_pipeline_and_frees_what_was_in_flight() -> None:
    executor = FakeExecutor(vocab_size=VOCAB, max_total_tokens=1024, stages=3)
    scheduler = make_scheduler(executor, chunked_prefill_size=16)
    results = Results()
    all_prompts = prompts(9, 2)
    for rid, prompt in all_prompts.items():
        submit(scheduler, results, rid, prompt, 20)
    victims = ["r1", "r4", "r0"]  # r0: a long prompt, aborted while chunks of it are in flight
    for victim in victims:
        results.take(scheduler.step())
        results.take(scheduler.step())
        assert scheduler.pipeline is not None and scheduler.pipeline.in_flight, "nothing in flight"
        results.take(scheduler.abort(victim))
        check_kv_accounting(scheduler)
        # The abort let every micro-batch land first; nothing is left in a stage's hands.
        assert not scheduler.pipeline.in_flight and not scheduler.queues.in_flight
    run_until_idle(scheduler, results)
    for rid, prompt in all_prompts.items():
        if rid in victims:
            assert results.finish[rid].type == "abort"
            got = results.tokens.get(rid, [])
            assert got == expected_output(prompt, 20, VOCAB)[: len(got)]
        else:
            assert results.tokens[rid] == expected_output(prompt, 20, VOCAB), rid
    scheduler.check_kv_invariant()


def test_retraction_waits_until_it_can_choose_among_every_request() -> None:
    """Two requests that cannot both finish in the pool: when the one at rest cannot decode while
    the other's micro-batch holds the rest, the scheduler lets the pipeline drain and retracts
    then, as one stage would, instead of giving up on a partial view."""
    executor = FakeExecutor(vocab_size=VOCAB, max_total_tokens=64, stages=2)
    # Admission that expects little output: both are admitted, then outgrow the pool together.
    scheduler = make_scheduler(executor, schedule_conservativeness=0.005)
    serve_and_check(scheduler, {"a": list(range(1, 11)), "b": list(range(20, 30))}, 40)
    assert scheduler.stats.retracted_reqs > 0


def test_chunks_of_one_prompt_fill_the_pipeline() -> None:
    """A lone long prompt: its next chunk needs no token, so every stage gets one at once."""
    executor = FakeExecutor(vocab_size=VOCAB, stages=3)
    scheduler = make_scheduler(executor, chunked_prefill_size=16)
    serve_and_check(scheduler, {"long": [(5 * i + 3) % VOCAB for i in range(120)]}, 6)
    assert [b.extend_lens for b in executor.prefills] == [[16]] * 7 + [[8]]
    assert executor.most_in_flight == 3


def outputs_of(scheduler_stages: int, request: GenerateRequest) -> list[ReqOutput]:
    executor = FakeExecutor(vocab_size=VOCAB, stages=scheduler_stages)
    scheduler = make_scheduler(executor, chunked_prefill_size=16)
    outputs = [o for o in scheduler.handle(request) if isinstance(o, ReqOutput)]
    while not scheduler.is_idle:
        outputs += [o for o in scheduler.step() if isinstance(o, ReqOutput)]
    scheduler.step()
    scheduler.check_kv_invariant()
    return outputs


@pytest.mark.parametrize("wants", ["input_logprobs", "prompt_hidden_states"])
def test_a_prompt_wanting_per_chunk_results_gets_one_stages(wants: str) -> None:
    """Prompt logprobs and hidden states are noted on the request chunk by chunk, so its chunks go
    through the pipeline one at a time, and the results equal one stage's."""
    prompt = [(11 * i + 1) % VOCAB for i in range(70)]
    fields = (
        {"return_logprob": True, "logprob_start_len": 0}
        if wants == "input_logprobs"
        else {"return_hidden_states": True}
    )
    request = GenerateRequest(
        "r", prompt, SamplingParams.from_dict({"max_new_tokens": 4, "temperature": 0.0}), **fields
    )
    one, two = outputs_of(1, request), outputs_of(2, request)
    assert [o.new_token_ids for o in two] == [o.new_token_ids for o in one]
    assert [getattr(o, wants) for o in two] == [getattr(o, wants) for o in one]
    assert any(getattr(o, wants) for o in two)
