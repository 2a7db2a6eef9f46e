"""Greedy fp32 output must equal transformers token for token, whatever the scheduler does."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.engine.oracle import GREEDY, GreedyOracle, assert_results_match, random_prompts

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "phi3"]
MAX_NEW = 12


def _run(engine: Any, prompts: list[list[int]], max_new: int = MAX_NEW) -> list[dict[str, Any]]:
    results = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": max_new})
    assert isinstance(results, list)
    return results


# RoPE variants (layers/rotary.py): YaRN, LongRoPE within its original context, a partial rotary
# factor (Phi-4-mini's), dynamic NTK decoding past its original context.
SCALED_ARCHS = ["qwen3_yarn", "phi3_longrope", "phi3_partial", "llama_dynamic"]
# Mixture of Experts (models/moe.py).
MOE_ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"]


@pytest.mark.parametrize("arch", ARCHS + SCALED_ARCHS + MOE_ARCHS)
def test_single_prompt(
    arch: str,
    tiny_model_dir: Callable[[str], Path],
    oracle: Callable[[str], GreedyOracle],
    make_engine: Callable[..., Any],
) -> None:
    engine = make_engine(tiny_model_dir(arch))
    prompts = random_prompts(1, [17])
    assert_results_match(_run(engine, prompts), prompts, oracle(arch), MAX_NEW)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3", *MOE_ARCHS])
def test_sixteen_mixed_lengths_at_once(
    arch: str,
    tiny_model_dir: Callable[[str], Path],
    oracle: Callable[[str], GreedyOracle],
    make_engine: Callable[..., Any],
) -> None:
    engine = make_engine(tiny_model_dir(arch))
    prompts = random_prompts(16, seed=1)
    assert_results_match(_run(engine, prompts), prompts, oracle(arch), MAX_NEW)


def _shared_prefix_prompts(n: int, prefix_len: int = 64, seed: int = 2) -> list[list[int]]:
    prefix = random_prompts(1, [prefix_len], seed=seed)[0]
    tails = random_prompts(n, seed=seed + 1)
    return [prefix + tail for tail in tails]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_shared_prefix_together_and_sequential(
    arch: str,
    tiny_model_dir: Callable[[str], Path],
    oracle: Callable[[str], GreedyOracle],
    make_engine: Callable[..., Any],
) -> None:
    engine = make_engine(tiny_model_dir(arch), schedule_policy="lpm")
    prompts = _shared_prefix_prompts(8)
    together = _run(engine, prompts)
    assert_results_match(together, prompts, oracle(arch), MAX_NEW)
    # In-batch deduplication: one request computes the prefix, the rest reuse it.
    assert sum(r["meta_info"]["cached_tokens"] > 0 for r in together) >= len(prompts) - 1

    later = _shared_prefix_prompts(4, seed=2)
    for prompt in later:
        (res,) = _run(engine, [prompt])
        assert res["meta_info"]["cached_tokens"] >= 64
        assert res["output_ids"] == oracle(arch).continue_(prompt, MAX_NEW)


def test_repeat_of_a_finished_request_hits_its_output_kv(
    tiny_model_dir: Callable[[str], Path],
    oracle: Callable[[str], GreedyOracle],
    make_engine: Callable[..., Any],
) -> None:
    engine = make_engine(tiny_model_dir("llama"))
    prompt = random_prompts(1, [40], seed=9)[0]
    (first,) = _run(engine, [prompt])
    # The continuation of the first answer is cached too: prompt + output (minus the last token).
    follow_up = prompt + first["output_ids"]
    (second,) = _run(engine, [follow_up])
    assert second["meta_info"]["cached_tokens"] == len(follow_up) - 1
    assert second["output_ids"] == oracle("llama").continue_(follow_up, MAX_NEW)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_chunked_prefill(
    arch: str,
    tiny_model_dir: Callable[[str], Path],
    oracle: Callable[[str], GreedyOracle],
    make_engine: Callable[..., Any],
) -> None:
    engine = make_engine(tiny_model_dir(arch), chunked_prefill_size=16)
    prompts = random_prompts(3, [200, 200, 77], seed=3)
    assert_results_match(_run(engine, prompts), prompts, oracle(arch), MAX_NEW)
    assert engine.get_stats()["prefill_batches"] >= 200 // 16


def test_mixed_chunk(
    tiny_model_dir: Callable[[str], Path],
    oracle: Callable[[str], GreedyOracle],
    make_engine: Callable[..., Any],
) -> None:
    engine = make_engine(tiny_model_dir("llama"), chunked_prefill_size=16, enable_mixed_chunk=True)
    prompts = random_prompts(6, [5, 90, 130, 7, 64, 200], seed=4)
    assert_results_match(_run(engine, prompts, 20), prompts, oracle("llama"), 20)


@pytest.mark.parametrize(("page_size", "cpu_kernels"), [(1, "auto"), (4, "auto"), (1, "torch")])
def test_retraction_under_a_tiny_kv_pool(
    page_size: int,
    cpu_kernels: str,
    tiny_model_dir: Callable[[str], Path],
    oracle: Callable[[str], GreedyOracle],
    make_engine: Callable[..., Any],
) -> None:
    engine = make_engine(
        tiny_model_dir("llama"),
        max_total_tokens=256,
        page_size=page_size,
        schedule_conservativeness=0.1,
        cpu_kernels=cpu_kernels,
    )
    prompts = random_prompts(8, [20, 25, 30, 18, 22, 27, 31, 19], seed=5)
    max_new = 40
    assert_results_match(_run(engine, prompts, max_new), prompts, oracle("llama"), max_new)
    stats = engine.get_stats()
    assert stats["retracted_reqs"] > 0
    if cpu_kernels == "torch":
        # Decode staging (attention/staging.py) kept K/V across steps and refilled after changes.
        assert stats["decode_staging_appends"] > 0 and stats["decode_staging_refills"] > 1
    else:
        # The native decode kernel reads the pool in place: nothing to stage.
        assert stats["decode_staging_tokens"] == stats["decode_staging_appends"] == 0


def test_decode_attention_without_staging(
    tiny_model_dir: Callable[[str], Path],
    oracle: Callable[[str], GreedyOracle],
    make_engine: Callable[..., Any],
) -> None:
    """Torch ops with --decode-staging-tokens 0: every decode step gathers its K/V from the pool."""
    engine = make_engine(
        tiny_model_dir("llama"), decode_staging_tokens=0, schedule_policy="lpm", cpu_kernels="torch"
    )
    prompts = random_prompts(8, seed=1) + _shared_prefix_prompts(4)
    assert_results_match(_run(engine, prompts), prompts, oracle("llama"), MAX_NEW)
    stats = engine.get_stats()
    assert stats["decode_staging_appends"] == stats["decode_staging_refills"] == 0


@pytest.mark.parametrize("policy", ["fcfs", "lpm", "dfs-weight", "lof", "random"])
def test_each_policy(
    policy: str,
    tiny_model_dir: Callable[[str], Path],
    oracle: Callable[[str], GreedyOracle],
    make_engine: Callable[..., Any],
) -> None:
    engine = make_engine(tiny_model_dir("qwen3"), schedule_policy=policy, max_prefill_tokens=128)
    prompts = _shared_prefix_prompts(5, prefix_len=40, seed=6) + random_prompts(5, seed=7)
    assert_results_match(_run(engine, prompts), prompts, oracle("qwen3"), MAX_NEW)


@pytest.mark.parametrize("page_size", [1, 4])
def test_page_size(
    page_size: int,
    tiny_model_dir: Callable[[str], Path],
    oracle: Callable[[str], GreedyOracle],
    make_engine: Callable[..., Any],
) -> None:
    engine = make_engine(tiny_model_dir("llama"), page_size=page_size, chunked_prefill_size=16)
    prompts = _shared_prefix_prompts(6, prefix_len=37, seed=8) + random_prompts(4, seed=10)
    assert_results_match(_run(engine, prompts), prompts, oracle("llama"), MAX_NEW)
    (again,) = _run(engine, [prompts[0]])
    cached = again["meta_info"]["cached_tokens"]
    assert cached > 0 and cached % page_size == 0
    assert again["output_ids"] == oracle("llama").continue_(prompts[0], MAX_NEW)


def test_disable_radix_cache(
    tiny_model_dir: Callable[[str], Path],
    oracle: Callable[[str], GreedyOracle],
    make_engine: Callable[..., Any],
) -> None:
    engine = make_engine(tiny_model_dir("llama"), disable_radix_cache=True, chunked_prefill_size=16)
    prompts = _shared_prefix_prompts(4, seed=11)
    results = _run(engine, prompts)
    assert_results_match(results, prompts, oracle("llama"), MAX_NEW)
    assert all(r["meta_info"]["cached_tokens"] == 0 for r in results)


def test_sharded_checkpoint(tiny_model_sharded_dir: Path, make_engine: Callable[..., Any]) -> None:
    oracle = GreedyOracle(tiny_model_sharded_dir)
    engine = make_engine(tiny_model_sharded_dir)
    prompts = random_prompts(2, seed=12)
    assert_results_match(_run(engine, prompts), prompts, oracle, MAX_NEW)
