"""--pp-size 2: two gloo ranks, each holding half the layers, give transformers' greedy tokens and
PP 1's sampled ones and logprobs, whatever the batching, caching or chunking, with micro-batches
in flight on both stages at once; also with --tp-size 2 inside each stage (four ranks), and with
requests aborted mid-flight. Retraction and Qwen2/Qwen3 under --pp-size 2:
tests/engine/test_tensor_parallel.py."""

from __future__ import annotations

import queue
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from radixserve.runtime.engine import Engine
from tests.engine.oracle import (
    GREEDY,
    GreedyOracle,
    assert_batched_and_cached_match,
    assert_greedy_matches,
    final_output,
    random_prompts,
    sampled_like_one_rank,
)

MAX_NEW = 12


def test_two_stages_batched_cached_chunked_and_sampled(
    tiny_model_dir: Callable[[str], Path],
    oracle: Callable[[str], GreedyOracle],
    make_engine: Callable[..., Engine],
) -> None:
    path = tiny_model_dir("llama")
    engine = make_engine(path, pp_size=2, chunked_prefill_size=16, schedule_policy="lpm")
    assert_batched_and_cached_match(engine, oracle("llama"), MAX_NEW)
    # Rank 0 samples from the last stage's logits: one rank's tokens and logprobs.
    single = make_engine(path, chunked_prefill_size=16, schedule_policy="lpm")
    for mine, theirs in sampled_like_one_rank(engine, single, return_logprob=True):
        ours = [lp for lp, _, _ in mine["meta_info"]["output_token_logprobs"]]
        ref = [lp for lp, _, _ in theirs["meta_info"]["output_token_logprobs"]]
        assert ours == pytest.approx(ref, abs=1e-5)
    # Rank 0 holds the embedding and the first layer, not the second: fewer bytes than one rank.
    weights = [e.get_stats()["resident_bytes"]["weights"] for e in (single, engine)]
    assert weights[1] < weights[0]
    assert_stages_overlapped(engine)


def test_two_stages_of_two_tensor_parallel_ranks(
    tiny_model_dir: Callable[[str], Path],
    oracle: Callable[[str], GreedyOracle],
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine(tiny_model_dir("llama"), tp_size=2, pp_size=2, chunked_prefill_size=16)
    assert_greedy_matches(engine, random_prompts(8, seed=7), oracle("llama"), MAX_NEW)
    assert_stages_overlapped(engine)


def assert_stages_overlapped(engine: Engine) -> None:
    """Micro-batches ran: on some ticks both stages had one (scheduler/pipeline.py)."""
    pipeline = engine.get_stats()["pipeline"]
    assert pipeline["stages"] == 2
    assert pipeline["busy_stage_ticks"] > pipeline["ticks"] > 0


def test_two_stages_abort_requests_with_micro_batches_in_flight(
    tiny_model_dir: Callable[[str], Path],
    oracle: Callable[[str], GreedyOracle],
    make_engine: Callable[..., Engine],
) -> None:
    """Requests aborted one by one while both stages hold micro-batches: the others still give
    transformers' tokens, and both ranks end idle with their KV accounting intact (make_engine)."""
    engine = make_engine(tiny_model_dir("llama"), pp_size=2, chunked_prefill_size=16)
    long_boxes: dict[str, queue.Queue[Any]] = {}
    for i, prompt in enumerate(random_prompts(4, seed=40)):
        rid = f"long-{i}"
        long_boxes[rid] = queue.Queue()
        params = {**GREEDY, "max_new_tokens": 2000, "ignore_eos": True}
        engine.submit(engine.requests.build(prompt, params, rid=rid), long_boxes[rid].put)
    short_prompts = random_prompts(4, seed=41)
    short_boxes: list[queue.Queue[Any]] = []
    for prompt in short_prompts:
        short_boxes.append(queue.Queue())
        request = engine.requests.build(prompt, {**GREEDY, "max_new_tokens": MAX_NEW})
        engine.submit(request, short_boxes[-1].put)
    for rid, box in long_boxes.items():
        got = 0
        while got < 3:
            got += len(box.get(timeout=60).new_token_ids)
        engine.abort(rid, exact=True)
    for box in long_boxes.values():
        assert final_output(box).finished_reason.type == "abort"
    for prompt, box in zip(short_prompts, short_boxes, strict=True):
        ids: list[int] = []
        out = box.get(timeout=60)
        ids += out.new_token_ids
        while out.finished_reason is None:
            out = box.get(timeout=60)
            ids += out.new_token_ids
        assert ids == oracle("llama").continue_(prompt, MAX_NEW)
    assert_stages_overlapped(engine)
