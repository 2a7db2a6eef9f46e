"""Multi-LoRA scheduling (scheduler/lora.py) over the fake executor, whose adapters each shift its
predicted tokens by their own amount, read from what the slot a row names holds when it runs: a
request reading another adapter's slot, or a slot refilled under a running request, gives wrong
tokens. Batches hold at most --max-loras-per-batch adapters."""

from __future__ import annotations

import pytest

from radixserve.protocol.messages import ControlRequest, GenerateRequest
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
NAMES = ["x", "y", "z"]


def lora_scheduler(slots: int, stages: int = 1, **args: object) -> tuple[Scheduler, FakeExecutor]:
    executor = FakeExecutor(vocab_size=VOCAB, max_total_tokens=2048, stages=stages)
    for name in NAMES:
        executor.load_lora(name, f"/adapters/{name}")
    scheduler = make_scheduler(
        executor,
        enable_lora=True,
        max_lora_rank=4,
        lora_target_modules=["all"],
        max_loras_per_batch=slots,
        **args,
    )
    return scheduler, executor


def submit_with(
    scheduler: Scheduler, results: Results, rid: str, prompt: list[int], max_new: int, adapter: str | None
) -> None:
    results.take(
        scheduler.handle(
            GenerateRequest(rid, prompt, SamplingParams.from_dict(greedy(max_new)), lora_path=adapter)
        )
    )


@pytest.mark.parametrize(("slots", "stages"), [(3, 1), (2, 1), (1, 1), (2, 2)])
def test_each_request_gets_its_adapter_and_batches_fit_the_slots(slots: int, stages: int) -> None:
    scheduler, executor = lora_scheduler(slots, stages, chunked_prefill_size=16)
    results = Results()
    jobs = {
        f"r{i}": ([(13 * i + j) % VOCAB for j in range(5 + 7 * (i % 5))], [None, *NAMES][i % 4])
        for i in range(16)
    }
    for rid, (prompt, adapter) in jobs.items():
        submit_with(scheduler, results, rid, prompt, 9 + i % 3 if (i := int(rid[1:])) else 9, adapter)
    run_until_idle(scheduler, results)
    for rid, (prompt, adapter) in jobs.items():
        i = int(rid[1:])
        assert results.tokens[rid] == expected_output(prompt, 9 + i % 3 if i else 9, VOCAB, adapter), rid
    assert max(len(adapters) for adapters in executor.batch_adapters) <= slots
    scheduler.check_kv_invariant()


def test_an_unknown_adapter_is_a_400_and_unloading_waits_for_its_requests() -> None:
    scheduler, _ = lora_scheduler(2)
    results = Results()
    submit_with(scheduler, results, "unknown", [1, 2, 3], 4, "nope")
    assert results.finish["unknown"].type == "abort"
    assert "not loaded" in (results.finish["unknown"].message or "")
    submit_with(scheduler, results, "uses-x", [1, 2, 3], 30, "x")
    results.take(scheduler.step())
    results.take(scheduler.handle(ControlRequest("unload", "unload_lora_adapter", {"lora_name": "x"})))
    refused = results.controls[-1]
    assert not refused.ok and "in use" in (refused.error or "")
    run_until_idle(scheduler, results)
    results.take(scheduler.handle(ControlRequest("unload-2", "unload_lora_adapter", {"lora_name": "x"})))
    assert results.controls[-1].ok and results.controls[-1].payload["loaded_adapters"] == {
        "y": "/adapters/y",
        "z": "/adapters/z",
    }
    assert results.tokens["uses-x"] == expected_output([1, 2, 3], 30, VOCAB, "x")
    scheduler.check_kv_invariant()


def test_a_request_naming_an_adapter_needs_enable_lora() -> None:
    scheduler = make_scheduler(FakeExecutor(vocab_size=VOCAB))
    results = Results()
    submit_with(scheduler, results, "r", [1, 2, 3], 4, "x")
    assert results.finish["r"].type == "abort"
    assert "--enable-lora" in (results.finish["r"].message or "")


def test_a_slot_in_use_is_never_refilled() -> None:
    """Two slots: x (running long), then y (done), then z arrives. z takes y's slot, though x's was
    filled first: x's request still runs."""
    scheduler, executor = lora_scheduler(2)
    results = Results()
    submit_with(scheduler, results, "long-x", [4, 5, 6], 40, "x")
    results.take(scheduler.step())
    submit_with(scheduler, results, "short-y", [7, 8], 2, "y")
    for _ in range(4):
        results.take(scheduler.step())
    assert "short-y" in results.finish and "long-x" not in results.finish
    submit_with(scheduler, results, "then-z", [9, 10, 11], 5, "z")
    run_until_idle(scheduler, results)
    assert results.tokens["long-x"] == expected_output([4, 5, 6], 40, VOCAB, "x")
    assert results.tokens["then-z"] == expected_output([9, 10, 11], 5, VOCAB, "z")
    assert sorted(executor.lora_slots.values()) == ["x", "z"]
