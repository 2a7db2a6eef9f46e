"""--tp-size 2: two gloo ranks, each with half the weights, give transformers' greedy tokens and
TP 1's sampled ones, whatever the batching, caching, chunking, retraction or grammar (retraction
and the other architectures with --pp-size 2 too)."""

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


def test_two_ranks_batched_cached_chunked_and_sampled(
    tiny_model_dir: Callable[[str], Path],
    oracle: Callable[[str], GreedyOracle],
    make_engine: Callable[..., Engine],
) -> None:
    path = tiny_model_dir("llama")
    engine = make_engine(path, tp_size=2, chunked_prefill_size=16, schedule_policy="lpm")
    # Chunked where longer than 16 tokens; rank 0 samples for both.
    assert_batched_and_cached_match(engine, oracle("llama"), MAX_NEW)
    single = make_engine(path, chunked_prefill_size=16, schedule_policy="lpm")
    sampled_like_one_rank(engine, single)

    # Rank 0 holds about half the bytes: all but the norms and rope tables (copied to every rank)
    # are split; tests/layers/test_tensor_parallel_layers.py checks the split exactly.
    weights = [e.get_stats()["resident_bytes"]["weights"] for e in (single, engine)]
    assert 0.5 * weights[0] < weights[1] < 0.6 * weights[0]
    # Reading a weight gathers the ranks' shards: rows, columns or vocabulary split alike.
    for name in (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.self_attn.v_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.layers.1.mlp.up_proj.weight",
        "model.embed_tokens.weight",
        "model.norm.weight",
    ):
        assert engine.get_weights_by_name(name, 10**6) == single.get_weights_by_name(name, 10**6), name


# Tensor and pipeline parallelism alike (tests/engine/test_pipeline_parallel.py has the rest of PP's).
SPLITS = [{"tp_size": 2}, {"pp_size": 2}]


@pytest.mark.parametrize("split", SPLITS, ids=["tp2", "pp2"])
def test_two_ranks_retract_under_a_tiny_kv_pool(
    split: dict[str, int],
    tiny_model_dir: Callable[[str], Path],
    oracle: Callable[[str], GreedyOracle],
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine(
        tiny_model_dir("llama"), **split, max_total_tokens=256, schedule_conservativeness=0.1
    )
    prompts = random_prompts(8, [20, 25, 30, 18, 22, 27, 31, 19], seed=5)
    assert_greedy_matches(engine, prompts, oracle("llama"), 40)
    assert engine.get_stats()["retracted_reqs"] > 0


@pytest.mark.parametrize("split", SPLITS, ids=["tp2", "pp2"])
@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "gemma3"])
def test_two_ranks_on_the_other_architectures(
    arch: str,
    split: dict[str, int],
    tiny_model_dir: Callable[[str], Path],
    oracle: Callable[[str], GreedyOracle],
    make_engine: Callable[..., Engine],
) -> None:
    """q/k/v biases and an untied head (Qwen2), q/k norms (Qwen3), and Gemma 3's four norms a layer
    with sliding layers, its prompts running past their window."""
    engine = make_engine(tiny_model_dir(arch), **split)
    assert_greedy_matches(engine, random_prompts(8, seed=6), oracle(arch), MAX_NEW)
