"""Speculative decoding end to end, NGRAM and STANDALONE, on a tiny random-weight model: fp32
greedy outputs equal
transformers' and radixserve's own without speculation, token for token, whatever the batching,
caching, chunking, paging or retraction; logprobs, penalties and stops behave as without it.

A random model's text rarely repeats its prompt, so each test serves its prompts twice: the first
pass fills the shared n-gram index with their outputs, and the second drafts from it (the
"recently served text" case), which makes most drafts right and exercises acceptance.

A STANDALONE draft is the target model itself (so nearly every draft is accepted, and acceptance
is checked) or another random model with the same tokenizer (so nearly every draft is rejected).
The second pass then starts from the radix cache, the draft's K/V with it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import native_kernels_or_skip
from tests.engine.oracle import GREEDY, GreedyOracle, random_prompts

MAX_NEW = 24
# Drafting as the index offers: what the adaptive gate drafts depends on how fast this machine is.
NGRAM = {"speculative_algorithm": "NGRAM", "disable_speculative_adaptive": True}
STANDALONE = {"speculative_algorithm": "STANDALONE", "disable_speculative_adaptive": True}


def _speculation(args: dict[str, Any], tiny_model_dir: Callable[[str], Path]) -> dict[str, Any]:
    """Engine arguments: NGRAM's unless args name a STANDALONE draft ("draft": a tiny architecture)."""
    args = dict(args)
    if "draft" not in args:
        return {**NGRAM, **args}
    draft = str(tiny_model_dir(args.pop("draft")))
    return {**STANDALONE, "speculative_draft_model_path": draft, "speculative_num_steps": 3, **args}


def _generate(engine: Any, prompts: list[list[int]], **params: Any) -> list[dict[str, Any]]:
    sampling = {**GREEDY, "max_new_tokens": MAX_NEW, **params.pop("sampling", {})}
    results = engine.generate(input_ids=prompts, sampling_params=sampling, **params)
    assert isinstance(results, list)
    return results


def _spec_stats(engine: Any) -> dict[str, Any]:
    payload: dict[str, Any] = engine.control("get_stats").payload
    return payload


@pytest.mark.parametrize(
    "args",
    [
        {"attention_backend": "cpu_native"},
        {"attention_backend": "torch_native", "page_size": 4, "chunked_prefill_size": 8},
        {
            "attention_backend": "torch_native", "disable_radix_cache": True,
            "speculative_ngram_match_type": "PROB",
            "max_total_tokens": 200, "schedule_conservativeness": 0.05,
        },
        {"attention_backend": "cpu_native", "disable_speculative_adaptive": False},
        {"draft": "llama", "attention_backend": "cpu_native", "page_size": 4, "chunked_prefill_size": 8},
        {
            "draft": "qwen2", "attention_backend": "torch_native",
            "max_total_tokens": 200, "schedule_conservativeness": 0.05,
        },
    ],
    ids=[
        "cpu-native", "torch-paged-chunked", "torch-no-radix-prob-retracting", "adaptive",
        "standalone-self-draft-native-paged-chunked", "standalone-other-draft-torch-retracting",
    ],
)  # fmt: skip
def test_greedy_equals_transformers_with_drafts_accepted(
    args: dict[str, Any],
    tiny_model_dir: Callable[[str], Path],
    oracle: Callable[[str], GreedyOracle],
    make_engine: Callable[..., Any],
) -> None:
    if args["attention_backend"] == "cpu_native":
        native_kernels_or_skip()
    spec = _speculation(args, tiny_model_dir)
    engine = make_engine(tiny_model_dir("llama"), **spec)
    prompts = random_prompts(8, [9, 23, 40, 5, 17, 30, 12, 3], seed=11)
    for turn in range(2):
        for i, (result, prompt) in enumerate(zip(_generate(engine, prompts), prompts, strict=True)):
            assert result["output_ids"] == oracle("llama").continue_(prompt, MAX_NEW), (
                f"turn {turn}, prompt {i}"
            )
    stats = _spec_stats(engine)
    if "max_total_tokens" in args:
        assert stats["retracted_reqs"] > 0
    if not spec["disable_speculative_adaptive"]:
        return  # the adaptive gate's drafts depend on timings: only the outputs are checked
    if args.get("draft") == "qwen2":
        assert stats["spec_draft_tokens"] > 0  # another model's drafts: hardly any accepted
        return
    if "draft" in args:
        assert stats["speculative_draft_model_path"] == spec["speculative_draft_model_path"]
        # The target drafting for itself: its drafts are its own greedy tokens.
        assert stats["spec_accepted_tokens"] >= 0.8 * stats["spec_draft_tokens"]
    assert stats["spec_accepted_tokens"] >= len(prompts) * MAX_NEW // 2
    assert stats["avg_spec_accept_length"] > 1.5


@pytest.mark.parametrize("algorithm", ["NGRAM", "STANDALONE"])
def test_logprobs_penalties_stops_and_seeds_match_decoding_without_speculation(
    algorithm: str, tiny_model_dir: Callable[[str], Path], make_engine: Callable[..., Any]
) -> None:
    prompts = random_prompts(4, [14, 6, 27, 9], seed=12)
    plain = make_engine(tiny_model_dir("llama"), attention_backend="torch_native")
    spec = _speculation({} if algorithm == "NGRAM" else {"draft": "llama"}, tiny_model_dir)
    speculative = make_engine(tiny_model_dir("llama"), attention_backend="torch_native", **spec)
    reference = _generate(plain, prompts)
    _generate(speculative, prompts)  # fills the n-gram index (and the radix cache)
    # A stop token partway along the (accepted) repeat, and a cap inside a draft.
    stop = reference[0]["output_ids"][10]
    cases: list[dict[str, Any]] = [
        {"return_logprob": True, "top_logprobs_num": 3},
        {"sampling": {"frequency_penalty": 0.6, "presence_penalty": 0.2}},
        {"sampling": {"repetition_penalty": 1.3}},
        {"sampling": {"stop_token_ids": [stop], "min_new_tokens": 4}},
        {"sampling": {"max_new_tokens": 13}},
    ]
    for case in cases:
        expected = _generate(plain, prompts, **dict(case))
        got = _generate(speculative, prompts, **dict(case))
        for want, have in zip(expected, got, strict=True):
            assert have["output_ids"] == want["output_ids"], case
            assert have["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"], case
            if "return_logprob" in case:
                ours, theirs = (
                    have["meta_info"]["output_token_logprobs"],
                    want["meta_info"]["output_token_logprobs"],
                )
                assert len(ours) == len(have["output_ids"])
                for (lp, token, _), (ref_lp, ref_token, _) in zip(ours, theirs, strict=True):
                    assert token == ref_token and lp == pytest.approx(ref_lp, abs=1e-4)
                tops = have["meta_info"]["output_top_logprobs"], want["meta_info"]["output_top_logprobs"]
                assert [[t for _, t, _ in row] for row in tops[0]] == [
                    [t for _, t, _ in row] for row in tops[1]
                ]
    # Seeded sampling: a seeded request draws the same random numbers at the same output positions
    # with and without drafts, so (the logits being equal in fp32) it emits the very same tokens.
    requests = [
        {"temperature": 0.8, "top_k": 20, "seed": seed, "max_new_tokens": MAX_NEW} for seed in range(4)
    ]
    expected_sampled = plain.generate(input_ids=prompts, sampling_params=requests)
    for _ in range(2):  # the second time, the first time's outputs are drafted
        got_sampled = speculative.generate(input_ids=prompts, sampling_params=requests)
        assert [r["output_ids"] for r in got_sampled] == [r["output_ids"] for r in expected_sampled]
    assert _spec_stats(speculative)["spec_accepted_tokens"] > 0


@pytest.mark.parametrize("algorithm", ["NGRAM", "STANDALONE"])
def test_bf16_native_kernels_with_speculation(
    algorithm: str, tiny_model_dir: Callable[[str], Path], make_engine: Callable[..., Any]
) -> None:
    """bf16 on the native kernels: verify chains in the fused decode loop, and a draft model's
    decode steps there too."""
    native_kernels_or_skip()
    spec = _speculation({} if algorithm == "NGRAM" else {"draft": "llama"}, tiny_model_dir)
    engine = make_engine(tiny_model_dir("llama"), dtype="bfloat16", attention_backend="cpu_native", **spec)
    prompts = random_prompts(4, [30, 8, 19, 44], seed=13)
    first = _generate(engine, prompts)
    again = _generate(engine, prompts)
    assert all(len(r["output_ids"]) == MAX_NEW for r in first + again)
    assert _spec_stats(engine)["spec_accepted_tokens"] > 0


@pytest.mark.parametrize(
    "parallel",
    [{"tp_size": 2, "speculative_algorithm": "STANDALONE"}, {"dp_size": 2}],
    ids=["tp2-standalone-adaptive", "dp2"],
)
def test_speculation_across_ranks_and_replicas(
    parallel: dict[str, Any],
    tiny_model_dir: Callable[[str], Path],
    oracle: Callable[[str], GreedyOracle],
    make_engine: Callable[..., Any],
) -> None:
    """tp2: the STANDALONE draft model sharded like the target; adaptive, as served by default,
    which must keep the ranks' plans equal (their timings differ: rank 0's are shared)."""
    path = tiny_model_dir("llama")
    if parallel.get("speculative_algorithm") == "STANDALONE":
        spec = {**parallel, "speculative_draft_model_path": str(path)}
    else:
        spec = {**NGRAM, **parallel}
    engine = make_engine(path, attention_backend="torch_native", **spec)
    prompts = random_prompts(6, [9, 23, 40, 5, 17, 30], seed=14)
    for _ in range(2):
        for result, prompt in zip(_generate(engine, prompts), prompts, strict=True):
            assert result["output_ids"] == oracle("llama").continue_(prompt, MAX_NEW)
    # Before the costs are measured every request drafts one token, on either algorithm.
    assert _spec_stats(engine)["spec_draft_tokens"] > 0
    if "dp_size" in parallel:
        assert _spec_stats(engine)["spec_accepted_tokens"] > 0


def test_a_draft_model_that_cannot_draft_is_refused(
    tiny_model_dir: Callable[[str], Path], minilm_path: Path
) -> None:
    from radixserve.config.server_args import InvalidArgumentError, ServerArgs
    from radixserve.executor.model_runner import ModelRunner
    from radixserve.executor.runner_config import RunnerConfig
    from radixserve.scheduler.process import build_draft_runner

    args = ServerArgs(
        model_path=str(tiny_model_dir("llama")),
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path=str(minilm_path),
        dtype="float32",
        max_total_tokens=256,
    )
    target = ModelRunner(RunnerConfig.from_server_args(args))
    with pytest.raises(InvalidArgumentError, match="cannot draft here: it is an encoder"):
        build_draft_runner(args, target, target.parallel)
