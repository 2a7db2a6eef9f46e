"""Decode staging in a running scheduler: blocks outlive prefills of other requests, refill after a
retraction, and never change a token (greedy fp32 against transformers)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from radixserve.attention.torch_native import TorchNativeBackend
from radixserve.config.server_args import ServerArgs
from radixserve.protocol.messages import GenerateRequest
from radixserve.protocol.sampling_params import SamplingParams
from radixserve.scheduler.process import build_scheduler
from tests.engine.oracle import GREEDY, GreedyOracle, collect_tokens, random_prompts

MAX_NEW = 30


@pytest.mark.parametrize("kv_tokens", [4096, 200])
def test_blocks_outlive_prefills_of_other_requests(
    kv_tokens: int, tiny_model_dir: Callable[[str], Path], oracle: Callable[[str], GreedyOracle]
) -> None:
    """Four requests decode; two more arrive mid-way and are prefilled between decode steps. With
    4096 KV slots the first four keep appending through those prefills; with 200 they are also
    retracted and readmitted, which must refill their blocks."""
    args = ServerArgs(
        model_path=str(tiny_model_dir("llama")),
        dtype="float32",
        max_total_tokens=kv_tokens,
        schedule_conservativeness=0.1,
        disable_overlap_schedule=True,
        # Staging serves the torch decode attention; the native kernel reads the pool in place.
        cpu_kernels="torch",
    )
    scheduler = build_scheduler(args)
    backend = scheduler.executor.attention  # type: ignore[attr-defined]
    assert isinstance(backend, TorchNativeBackend)
    staging = backend.staging
    first, late = random_prompts(4, [20, 22, 21, 23], seed=40), random_prompts(2, [6, 40], seed=41)
    params = {**GREEDY, "max_new_tokens": MAX_NEW}
    tokens: dict[str, list[int]] = {}
    for i, prompt in enumerate(first):
        collect_tokens(
            list(scheduler.handle(GenerateRequest(f"first{i}", prompt, SamplingParams.from_dict(params)))),
            tokens,
        )
    for _ in range(6):
        collect_tokens(list(scheduler.step()), tokens)
    for i, prompt in enumerate(late):
        collect_tokens(
            list(scheduler.handle(GenerateRequest(f"late{i}", prompt, SamplingParams.from_dict(params)))),
            tokens,
        )
    collect_tokens(list(scheduler.step()), tokens)  # the late requests' prefill
    appends = staging.appends
    collect_tokens(list(scheduler.step()), tokens)  # a decode step: the first four's block continues
    if kv_tokens > 1000:
        assert staging.appends > appends
    while not scheduler.is_idle:
        collect_tokens(list(scheduler.step()), tokens)

    for name, prompt in [(f"first{i}", p) for i, p in enumerate(first)] + [
        (f"late{i}", p) for i, p in enumerate(late)
    ]:
        assert tokens[name] == oracle("llama").continue_(prompt, MAX_NEW), name
    if kv_tokens < 1000:
        assert scheduler.stats.retracted_reqs > 0
    assert staging.refills > 0 and staging.appends > 0
    scheduler.step()  # an idle step: the self-check runs and the blocks are given back
    assert staging.staged_tokens == 0
    scheduler.check_kv_invariant()
