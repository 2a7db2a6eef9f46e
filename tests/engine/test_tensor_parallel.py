"""--tp-size 2: two gloo ranks, each with half the weights, give transformers' greedy tokens and
TP 1's sampled ones, whatever the batching, caching, chunking, retraction or grammar."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from radixserve.runtime.engine import Engine
from tests.engine.oracle import GREEDY, GreedyOracle, random_prompts

MAX_NEW = 12


def _assert_greedy_matches(
    engine: Engine, prompts: list[list[int]], oracle: GreedyOracle, max_new: int
) -> None:
    results = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": max_new})
    assert isinstance(results, list)
    for i, (res, prompt) in enumerate(zip(results, prompts, strict=True)):
        assert res["output_ids"] == oracle.continue_(prompt, max_new), (
            f"prompt {i} (len {len(prompt)}) differs"
        )


def test_two_ranks_batched_cached_chunked_and_sampled(
    tiny_model_dir: Callable[[str], Path],
    oracle: Callable[[str], GreedyOracle],
    make_engine: Callable[..., Engine],
) -> None:
    path = tiny_model_dir("llama")
    engine = make_engine(path, tp_size=2, chunked_prefill_size=16, schedule_policy="lpm")
    # Batched: 16 prompts of mixed lengths at once, chunked where longer than 16 tokens.
    _assert_greedy_matches(engine, random_prompts(16, seed=1), oracle("llama"), MAX_NEW)
    # Cached: prompts that share a 64-token prefix, one after the other.
    prefix = random_prompts(1, [64], seed=2)[0]
    for tail in random_prompts(3, seed=3):
        (res,) = engine.generate(
            input_ids=[prefix + tail], sampling_params={**GREEDY, "max_new_tokens": MAX_NEW}
        )
        assert res["output_ids"] == oracle("llama").continue_(prefix + tail, MAX_NEW)
    assert res["meta_info"]["cached_tokens"] >= 64

    # Sampling (rank 0 samples for both) and a grammar give what one rank gives.
    single = make_engine(path, chunked_prefill_size=16, schedule_policy="lpm")
    requests: list[dict[str, Any]] = [
        {"temperature": 1.0, "top_p": 0.9, "seed": seed, "max_new_tokens": 16} for seed in range(6)
    ]
    requests += [{"temperature": 1.0, "seed": 7, "max_new_tokens": 16, "regex": r"[a-c]{2,4}-[0-9]{3}"}]
    prompts = random_prompts(len(requests), seed=4)
    two = engine.generate(input_ids=prompts, sampling_params=requests)
    one = single.generate(input_ids=prompts, sampling_params=requests)
    assert isinstance(two, list) and isinstance(one, list)
    assert [r["output_ids"] for r in two] == [r["output_ids"] for r in one]
    assert one[-1]["meta_info"]["finish_reason"]["type"] == "stop"

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


def test_two_ranks_retract_under_a_tiny_kv_pool(
    tiny_model_dir: Callable[[str], Path],
    oracle: Callable[[str], GreedyOracle],
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine(
        tiny_model_dir("llama"), tp_size=2, max_total_tokens=256, schedule_conservativeness=0.1
    )
    prompts = random_prompts(8, [20, 25, 30, 18, 22, 27, 31, 19], seed=5)
    _assert_greedy_matches(engine, prompts, oracle("llama"), 40)
    assert engine.get_stats()["retracted_reqs"] > 0


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_two_ranks_with_biases_qk_norms_and_an_untied_head(
    arch: str,
    tiny_model_dir: Callable[[str], Path],
    oracle: Callable[[str], GreedyOracle],
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine(tiny_model_dir(arch), tp_size=2)
    _assert_greedy_matches(engine, random_prompts(8, seed=6), oracle(arch), MAX_NEW)
