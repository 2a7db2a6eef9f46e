"""--pp-size 2: two gloo ranks, each holding half the layers, give transformers' greedy tokens and
PP 1's sampled ones and logprobs, whatever the batching, caching or chunking; and with --tp-size 2
inside each stage (four ranks). Retraction and Qwen2/Qwen3 under --pp-size 2:
tests/engine/test_tensor_parallel.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from radixserve.runtime.engine import Engine
from tests.engine.oracle import (
    GreedyOracle,
    assert_batched_and_cached_match,
    assert_greedy_matches,
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


def test_two_stages_of_two_tensor_parallel_ranks(
    tiny_model_dir: Callable[[str], Path],
    oracle: Callable[[str], GreedyOracle],
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine(tiny_model_dir("llama"), tp_size=2, pp_size=2, chunked_prefill_size=16)
    assert_greedy_matches(engine, random_prompts(8, seed=7), oracle("llama"), MAX_NEW)
