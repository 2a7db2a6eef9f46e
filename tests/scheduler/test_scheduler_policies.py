"""--schedule-policy as the scheduler applies it (fake executor): the order in which waiting requests
are admitted, read from the first prefill batch after they all arrive (its requests are in admission
order). Every prompt here ends in a token of its own, which names its request in the batch."""

from __future__ import annotations

import random
from typing import Any

import pytest

from radixserve.scheduler.scheduler import Scheduler
from tests.scheduler.fake_executor import (
    FakeExecutor,
    RecordedBatch,
    Results,
    expected_output,
    make_scheduler,
    run_until_idle,
    submit,
)

VOCAB = 4096


def _scheduler(**server_args: Any) -> tuple[Scheduler, FakeExecutor, Results]:
    executor = FakeExecutor(vocab_size=VOCAB)
    return make_scheduler(executor, **server_args), executor, Results()


def _warm(scheduler: Scheduler, results: Results, prompts: list[list[int]]) -> None:
    """Runs the prompts to the end, which leaves their KV in the radix cache."""
    for i, prompt in enumerate(prompts):
        submit(scheduler, results, f"warm{i}", prompt, 1)
    run_until_idle(scheduler, results)


def _admit(
    scheduler: Scheduler,
    executor: FakeExecutor,
    results: Results,
    prompts: dict[str, list[int]],
    **max_new: int,
) -> RecordedBatch:
    """Submits the prompts in order and returns the prefill batch that admits them."""
    for rid, prompt in prompts.items():
        submit(scheduler, results, rid, prompt, max_new.get(rid, 3))
    seen = len(executor.batches)
    results.take(scheduler.step())
    (batch,) = executor.batches[seen:]
    assert batch.is_prefill and len(batch.extend_lens) == len(prompts), "all are admitted at once"
    return batch


def _order(batch: RecordedBatch, prompts: dict[str, list[int]]) -> list[str]:
    owner = {prompt[-1]: rid for rid, prompt in prompts.items()}
    return [owner[segment[-1]] for segment in batch.segments]


def _finish(scheduler: Scheduler, results: Results, prompts: dict[str, list[int]], **max_new: int) -> None:
    run_until_idle(scheduler, results)
    for rid, prompt in prompts.items():
        assert results.tokens[rid] == expected_output(prompt, max_new.get(rid, 3), VOCAB)
    scheduler.check_kv_invariant()


def test_fcfs_admits_in_arrival_order() -> None:
    scheduler, executor, results = _scheduler(schedule_policy="fcfs")
    prompts = {rid: [10 * i + 1, 10 * i + 2, 10 * i + 3] for i, rid in enumerate(["x", "y", "z"])}
    for rid, prompt in prompts.items():
        submit(scheduler, results, rid, prompt, 3)
    # Arrival order, not queue position: a retraction puts requests at the end of the queue.
    scheduler.queues.waiting.reverse()
    results.take(scheduler.step())
    assert _order(executor.batches[-1], prompts) == ["x", "y", "z"]
    _finish(scheduler, results, prompts)


# A cached text, and prompts that share 0, 5 and 15 of its tokens.
CACHED = list(range(1000, 1020))
BY_PREFIX = {
    "none": [1, 2, 3, 4],
    "short": [*CACHED[:5], 50, 51],
    "long": [*CACHED[:15], 60, 61],
}


@pytest.mark.parametrize(
    ("policy", "disable_radix_cache", "order"),
    [
        ("lpm", False, ["long", "short", "none"]),
        ("fcfs", False, ["none", "short", "long"]),
        # Without a radix cache nothing is cached: lpm falls back to arrival order.
        ("lpm", True, ["none", "short", "long"]),
    ],
)
def test_lpm_admits_the_longest_cached_prefix_first(
    policy: str, disable_radix_cache: bool, order: list[str]
) -> None:
    scheduler, executor, results = _scheduler(schedule_policy=policy, disable_radix_cache=disable_radix_cache)
    _warm(scheduler, results, [[*CACHED, 2000]])
    batch = _admit(scheduler, executor, results, BY_PREFIX)
    assert _order(batch, BY_PREFIX) == order
    cached = {"none": 0, "short": 5, "long": 15}
    assert batch.prefix_lens == [0 if disable_radix_cache else cached[rid] for rid in order]
    _finish(scheduler, results, BY_PREFIX)


# Two cached branches; two waiting requests continue branch A, one (the first to arrive) branch B.
BRANCH_A, BRANCH_B = list(range(100, 110)), list(range(200, 210))
BY_BRANCH = {
    "b1": [*BRANCH_B, 300, 301],
    "a1": [*BRANCH_A, 310, 311],
    "a2": [*BRANCH_A, 320, 321],
}


@pytest.mark.parametrize(
    ("policy", "order"),
    [
        # The branch with more waiting requests first, so that they run back to back.
        ("dfs-weight", ["a1", "a2", "b1"]),
        # The same cached length for all: arrival order.
        ("lpm", ["b1", "a1", "a2"]),
    ],
)
def test_dfs_weight_admits_the_heaviest_branch_first(policy: str, order: list[str]) -> None:
    scheduler, executor, results = _scheduler(schedule_policy=policy)
    _warm(scheduler, results, [[*BRANCH_A, 2001], [*BRANCH_B, 2002]])
    batch = _admit(scheduler, executor, results, BY_BRANCH)
    assert _order(batch, BY_BRANCH) == order
    assert batch.prefix_lens == [len(BRANCH_A)] * 3
    _finish(scheduler, results, BY_BRANCH)


def test_lof_admits_the_longest_output_first() -> None:
    scheduler, executor, results = _scheduler(schedule_policy="lof")
    prompts = {rid: [10 * i + 1, 10 * i + 2] for i, rid in enumerate(["x", "y", "z", "w"])}
    max_new = {"x": 3, "y": 9, "z": 6, "w": 9}
    batch = _admit(scheduler, executor, results, prompts, **max_new)
    # Most max_new_tokens first; equal ones in arrival order.
    assert _order(batch, prompts) == ["y", "w", "z", "x"]
    _finish(scheduler, results, prompts, **max_new)


def _random_order(seed: int) -> list[str]:
    scheduler, executor, results = _scheduler(schedule_policy="random", random_seed=seed)
    prompts = {f"r{i}": [10 * i + 1, 10 * i + 2] for i in range(6)}
    order = _order(_admit(scheduler, executor, results, prompts), prompts)
    _finish(scheduler, results, prompts)
    return order


def test_random_order_comes_from_the_seed() -> None:
    arrival = [f"r{i}" for i in range(6)]
    for seed in (0, 7):
        expected = list(arrival)
        random.Random(seed).shuffle(expected)
        assert _random_order(seed) == expected
        assert _random_order(seed) == expected  # reproducible
    assert _random_order(0) != _random_order(7)
