"""Sliding-window attention served past the window: greedy fp32 output equals transformers token for
token (and logprobs within 1e-4), for Gemma 3 (sliding layers between global ones, each kind on its
own rotary base) and a Mistral whose every layer slides, whatever the scheduler does: batches,
chunked prefill on either side of the window, radix-cache hits whose prefix crosses it, retraction,
speculative verify steps."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from radixserve.config.server_args import ServerArgs
from radixserve.executor.model_runner import ModelRunner
from radixserve.executor.runner_config import RunnerConfig
from radixserve.kernels.cpu_ops import CpuKernels
from radixserve.models.llama import CausalLM
from radixserve.protocol.messages import GenerateRequest
from radixserve.protocol.sampling_params import SamplingParams
from radixserve.scheduler.process import build_scheduler
from tests.conftest import TINY_WINDOW
from tests.engine.oracle import GREEDY, GreedyOracle, assert_results_match, collect_tokens, random_prompts
from tests.engine.test_logprobs import TOLERANCE, reference_logprobs

WINDOWED = ["gemma3", "mistral_window"]
MAX_NEW = 16


def _run(
    engine: Any, prompts: list[list[int]], max_new: int = MAX_NEW, **params: Any
) -> list[dict[str, Any]]:
    results = engine.generate(
        input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": max_new}, **params
    )
    assert isinstance(results, list)
    return results


@pytest.mark.parametrize("backend", ["auto", "torch_native"])
@pytest.mark.parametrize("arch", WINDOWED)
def test_a_batch_within_and_past_the_window(
    arch: str,
    backend: str,
    tiny_model_dir: Callable[[str], Path],
    oracle: Callable[[str], GreedyOracle],
    make_engine: Callable[..., Any],
) -> None:
    """Prompts shorter than the window, as long, and up to 8x longer, one alone and then together;
    decode runs every request well past the window, to the model's own context (not the window).
    On cpu_native (auto: the native decode kernel reads each request's window) and torch_native."""
    engine = make_engine(tiny_model_dir(arch), attention_backend=backend)
    assert engine.context_len == 1024  # max_position_embeddings
    prompts = random_prompts(8, [5, TINY_WINDOW - 1, TINY_WINDOW, TINY_WINDOW + 1, 30, 47, 64, 96], seed=21)
    assert_results_match(_run(engine, prompts[-1:]), prompts[-1:], oracle(arch), MAX_NEW)
    assert_results_match(_run(engine, prompts), prompts, oracle(arch), MAX_NEW)


def test_the_runner_takes_cpu_native_and_the_fused_loop(
    tiny_model_dir: Callable[[str], Path], native_kernels: CpuKernels
) -> None:
    """The native decode kernel and the fused decode loop take a window: auto picks cpu_native,
    and decode steps run in the fused loop (tests/models/test_fused_decode.py checks its numbers)."""
    args = {"model_path": str(tiny_model_dir("gemma3")), "max_total_tokens": 256}
    runner = ModelRunner(RunnerConfig.from_server_args(ServerArgs(**args, dtype="bfloat16")))
    described = runner.describe()
    assert described["attention_backend"] == "cpu_native"
    assert runner.context_len == 1024 and runner.config.sliding_window == TINY_WINDOW
    assert isinstance(runner.model, CausalLM)
    if native_kernels.linear_kernel is not None:
        assert "fused" in described["decode_path"] and runner.model.fused_decode is not None
    # A context no longer than the window masks nothing: full attention, on the native paths.
    within = ModelRunner(
        RunnerConfig.from_server_args(ServerArgs(**args, dtype="bfloat16", context_length=TINY_WINDOW))
    )
    assert within.config.sliding_window is None
    assert within.describe()["attention_backend"] == "cpu_native"


@pytest.mark.parametrize("chunk", [5, 32])
def test_chunked_prefill_on_either_side_of_the_window(
    chunk: int,
    tiny_model_dir: Callable[[str], Path],
    oracle: Callable[[str], GreedyOracle],
    make_engine: Callable[..., Any],
) -> None:
    """Chunks shorter than the window (each chunk's window reaches into earlier chunks) and longer
    (a chunk's own queries leave its first keys behind), with decode requests riding along."""
    engine = make_engine(tiny_model_dir("gemma3"), chunked_prefill_size=chunk, enable_mixed_chunk=True)
    prompts = random_prompts(4, [100, 77, 7, 40], seed=22)
    assert_results_match(_run(engine, prompts), prompts, oracle("gemma3"), MAX_NEW)
    assert engine.get_stats()["prefill_batches"] >= 100 // chunk


@pytest.mark.parametrize("page_size", [1, 4])
def test_radix_hits_whose_prefix_crosses_the_window(
    page_size: int,
    tiny_model_dir: Callable[[str], Path],
    oracle: Callable[[str], GreedyOracle],
    make_engine: Callable[..., Any],
) -> None:
    """A cached prefix of 3-4 windows: the new tokens' sliding layers see only its end, their global
    layers all of it; then a finished request's own output as the next prompt's prefix."""
    engine = make_engine(tiny_model_dir("gemma3"), page_size=page_size)
    prefix = random_prompts(1, [41], seed=23)[0]
    prompts = [prefix + tail for tail in random_prompts(3, [3, 9, 20], seed=24)]
    assert_results_match(_run(engine, prompts[:1]), prompts[:1], oracle("gemma3"), MAX_NEW)
    later = _run(engine, prompts[1:])
    assert_results_match(later, prompts[1:], oracle("gemma3"), MAX_NEW)
    assert all(r["meta_info"]["cached_tokens"] >= 40 for r in later)
    follow_up = prompts[0] + oracle("gemma3").continue_(prompts[0], MAX_NEW)
    (again,) = _run(engine, [follow_up])
    assert again["meta_info"]["cached_tokens"] >= len(follow_up) - page_size
    assert again["output_ids"] == oracle("gemma3").continue_(follow_up, MAX_NEW)


@pytest.mark.parametrize(
    ("arch", "backend", "page_size"),
    [(arch, backend, 4) for arch in WINDOWED for backend in ("auto", "torch_native")]
    + [("gemma3", "auto", 1)],
)
def test_retraction_under_a_tiny_kv_pool(
    arch: str,
    backend: str,
    page_size: int,
    tiny_model_dir: Callable[[str], Path],
    oracle: Callable[[str], GreedyOracle],
    make_engine: Callable[..., Any],
) -> None:
    """Requests sent back to the queue and resumed from what the cache kept; on torch_native,
    decode staging keeps each bucket's K/V between steps and the windowed layers mask it; with
    pages of one token, the sliding layers' K/V in window slots, released as generation goes on."""
    engine = make_engine(
        tiny_model_dir(arch), max_total_tokens=256, page_size=page_size, schedule_conservativeness=0.1,
        attention_backend=backend,
    )  # fmt: skip
    assert engine.get_stats()["window_layers"] == (2 if page_size == 1 else 0)
    prompts = random_prompts(8, [20, 25, 30, 18, 22, 27, 31, 19], seed=25)
    max_new = 40
    assert_results_match(_run(engine, prompts, max_new), prompts, oracle(arch), max_new)
    stats = engine.get_stats()
    assert stats["retracted_reqs"] > 0
    if backend == "torch_native":
        assert stats["decode_staging_appends"] > 0 and stats["decode_staging_refills"] > 1


def test_output_logprobs_match_transformers(
    tiny_model_dir: Callable[[str], Path],
    oracle: Callable[[str], GreedyOracle],
    make_engine: Callable[..., Any],
) -> None:
    engine = make_engine(tiny_model_dir("gemma3"), chunked_prefill_size=16)
    prompts = random_prompts(3, [9, 37, 60], seed=26)
    params = [{**GREEDY, "max_new_tokens": 12}, {"temperature": 1.0, "seed": 4, "max_new_tokens": 12}, GREEDY]
    results = engine.generate(
        input_ids=prompts, sampling_params=params, return_logprob=True, top_logprobs_num=3
    )
    for prompt, result in zip(prompts, results, strict=True):
        output = result["output_ids"]
        expected = reference_logprobs(oracle("gemma3"), prompt, output)
        chosen = torch.tensor([value for value, _, _ in result["meta_info"]["output_token_logprobs"]])
        want = expected.gather(1, torch.tensor(output).unsqueeze(1)).squeeze(1)
        torch.testing.assert_close(chosen, want, atol=TOLERANCE, rtol=0)
        for position, top in enumerate(result["meta_info"]["output_top_logprobs"]):
            values, ids = expected[position].topk(3)
            assert [token for _, token, _ in top] == ids.tolist()
            torch.testing.assert_close(torch.tensor([v for v, _, _ in top]), values, atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize(
    "spec",
    [
        {"speculative_algorithm": "NGRAM", "speculative_ngram_match_type": "PROB", "page_size": 4},
        {"speculative_algorithm": "STANDALONE", "speculative_num_steps": 3, "chunked_prefill_size": 8},
    ],
    ids=["ngram-trees", "standalone-self-draft"],
)
def test_speculative_verify_steps(
    spec: dict[str, Any],
    tiny_model_dir: Callable[[str], Path],
    oracle: Callable[[str], GreedyOracle],
    make_engine: Callable[..., Any],
) -> None:
    """Verify steps (draft chains and trees) attend through the window as decode steps would."""
    if spec["speculative_algorithm"] == "STANDALONE":
        spec = {**spec, "speculative_draft_model_path": str(tiny_model_dir("gemma3"))}
    engine = make_engine(tiny_model_dir("gemma3"), disable_speculative_adaptive=True, **spec)
    prompts = random_prompts(4, [9, 23, 40, 30], seed=27)
    for _ in range(2):  # the second turn drafts from the first's outputs
        assert_results_match(_run(engine, prompts), prompts, oracle("gemma3"), MAX_NEW)
    stats: dict[str, Any] = engine.control("get_stats").payload
    assert stats["spec_accepted_tokens"] >= len(prompts) * MAX_NEW // 2


def test_generated_tokens_give_their_window_slots_back(
    tiny_model_dir: Callable[[str], Path],
    oracle: Callable[[str], GreedyOracle],
    make_engine: Callable[..., Any],
) -> None:
    """Window slots (cache/swa_pool.py, the default on cpu_native): the sliding layers' K/V of a
    generated token goes back once it left the window; the tree keeps the full layers' K/V of every
    token and continues from a prefix only where its last window is alive: the whole conversation
    for a follow-up, the prompt for a branch inside the released part."""
    engine = make_engine(tiny_model_dir("gemma3"))
    assert engine.get_stats()["window_layers"] == 2
    prompts = random_prompts(3, [20, 30, 9], seed=31)
    long = 80
    results = _run(engine, prompts, long)
    assert_results_match(results, prompts, oracle("gemma3"), long)
    stats = engine.get_stats()
    # Idle, the tree holds every token; of each request's generated ones, all but the last window
    # and one release batch (scheduler/batch.py) hold no window slot.
    released = stats["window_available_tokens"] - stats["available_tokens"]
    assert released >= 3 * (long - TINY_WINDOW - 16)

    conversation = prompts[0] + results[0]["output_ids"]
    follow_up = conversation + [5, 6, 7]
    (again,) = _run(engine, [follow_up])
    assert again["meta_info"]["cached_tokens"] >= len(conversation) - 1
    assert again["output_ids"] == oracle("gemma3").continue_(follow_up, MAX_NEW)

    branch = prompts[1] + results[1]["output_ids"][:50] + [8, 9]
    (branched,) = _run(engine, [branch])
    assert branched["meta_info"]["cached_tokens"] == len(prompts[1])
    assert branched["output_ids"] == oracle("gemma3").continue_(branch, MAX_NEW)


def test_without_the_radix_cache_prompt_chunks_give_theirs_back_too(
    tiny_model_dir: Callable[[str], Path], oracle: Callable[[str], GreedyOracle]
) -> None:
    """With nothing cached, a prompt's positions go back at each chunk's end as well: the window
    slots in use stay near the windows alive, not the tokens held."""
    scheduler = build_scheduler(
        ServerArgs(
            model_path=str(tiny_model_dir("mistral_window")), dtype="float32", max_total_tokens=1024,
            disable_radix_cache=True, chunked_prefill_size=16, log_level="warning",
        )
    )  # fmt: skip
    allocator = scheduler.kv.allocator
    prompts, max_new = random_prompts(2, [70, 45], seed=32), 40
    tokens: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        params = SamplingParams.from_dict({**GREEDY, "max_new_tokens": max_new})
        collect_tokens(list(scheduler.handle(GenerateRequest(f"r{i}", prompt, params))), tokens)
    held = peak = 0
    while not scheduler.is_idle:
        collect_tokens(list(scheduler.step()), tokens)
        available = allocator.window_available()
        assert available is not None
        held = max(held, allocator.total_slots - allocator.available_size())
        peak = max(peak, allocator.total_slots - available)
    for i, prompt in enumerate(prompts):
        assert tokens[f"r{i}"] == oracle("mistral_window").continue_(prompt, max_new)
    # Each request holds at most its window, a chunk or a release batch, and a token more.
    assert held >= 70 + max_new - 1 and peak <= 2 * (TINY_WINDOW + 16 + 1)
    scheduler.check_kv_invariant()


def test_the_cache_keeps_window_kv_within_its_budget(
    tiny_model_dir: Callable[[str], Path],
    oracle: Callable[[str], GreedyOracle],
    make_engine: Callable[..., Any],
) -> None:
    """--swa-full-tokens-ratio: the window slots the cache's prompts hold stay within the budget,
    the least recently used prompts' going first; a prompt whose window K/V went is recomputed
    (its full layers' K/V alone cannot serve it), and every output equals transformers."""
    total, ratio = 1024, 0.1
    engine = make_engine(tiny_model_dir("gemma3"), max_total_tokens=total, swa_full_tokens_ratio=ratio)
    budget = int(total * ratio)
    prompts = random_prompts(5, [40] * 5, seed=33)
    for prompt in prompts:
        (result,) = _run(engine, [prompt], 8)
        assert result["output_ids"] == oracle("gemma3").continue_(prompt, 8)
        stats = engine.get_stats()
        assert total - stats["window_available_tokens"] <= budget
    # Every prompt's full layers' K/V is cached still.
    assert engine.get_stats()["evictable_tokens"] >= 5 * 40
    (latest,) = _run(engine, [prompts[-1]], 8)
    assert latest["meta_info"]["cached_tokens"] >= 40 - 1
    (first,) = _run(engine, [prompts[0]], 8)
    assert first["meta_info"]["cached_tokens"] == 0
    assert first["output_ids"] == oracle("gemma3").continue_(prompts[0], 8)
