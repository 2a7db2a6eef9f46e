"""Output logprobs equal log_softmax of transformers' logits on the same weights (fp32, 1e-4)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from radixserve.protocol.sampling_params import InvalidRequestError
from tests.engine.oracle import GREEDY, GreedyOracle, random_prompts

TOLERANCE = 1e-4


@pytest.fixture
def engine(tiny_model_dir: Callable[[str], Path], make_engine: Callable[..., Any]) -> Any:
    return make_engine(tiny_model_dir("llama"), max_total_tokens=2048)


@torch.no_grad()
def reference_logprobs(oracle: GreedyOracle, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), vocab]: transformers' log_softmax at each position that predicted an output token."""
    logits = oracle.model(input_ids=torch.tensor([prompt + output])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) + len(output) - 1], dim=-1)


def test_output_logprobs_match_transformers(engine: Any, oracle: Callable[[str], GreedyOracle]) -> None:
    prompts = random_prompts(3, [9, 17, 5], seed=31)
    # Sampled at temperature 1 so that chosen tokens are not always the top one; logprobs are
    # still those of the raw distribution.
    params = [{**GREEDY, "max_new_tokens": 8}, {"temperature": 1.0, "seed": 4, "max_new_tokens": 8}, GREEDY]
    results = engine.generate(
        input_ids=prompts, sampling_params=params, return_logprob=True, top_logprobs_num=3
    )
    for prompt, result in zip(prompts, results, strict=True):
        output = result["output_ids"]
        meta = result["meta_info"]
        expected = reference_logprobs(oracle("llama"), prompt, output)
        chosen = torch.tensor([value for value, _, _ in meta["output_token_logprobs"]])
        assert [token for _, token, _ in meta["output_token_logprobs"]] == output
        torch.testing.assert_close(
            chosen, expected.gather(1, torch.tensor(output).unsqueeze(1)).squeeze(1), atol=TOLERANCE, rtol=0
        )
        for position, top in enumerate(meta["output_top_logprobs"]):
            values, ids = expected[position].topk(3)
            assert [token for _, token, _ in top] == ids.tolist()
            torch.testing.assert_close(torch.tensor([v for v, _, _ in top]), values, atol=TOLERANCE, rtol=0)


def test_logprobs_are_off_unless_asked_and_top_k_is_bounded(engine: Any) -> None:
    plain = engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2})
    assert "output_token_logprobs" not in plain["meta_info"]
    only_chosen = engine.generate(
        input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2}, return_logprob=True
    )
    assert only_chosen["meta_info"]["output_top_logprobs"] == [[], []]
    with pytest.raises(InvalidRequestError, match="top_logprobs_num"):
        engine.generate(input_ids=[5, 6], return_logprob=True, top_logprobs_num=21)


@torch.no_grad()
def reference_prompt_logprobs(oracle: GreedyOracle, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1]: transformers' logprob of prompt token i + 1 given the tokens before it."""
    logits = oracle.model(input_ids=torch.tensor([prompt])).logits[0].float()
    logprobs = torch.log_softmax(logits[:-1], dim=-1)
    return logprobs.gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)


def _prompt_values(result: dict[str, Any]) -> list[float | None]:
    return [value for value, _, _ in result["meta_info"]["input_token_logprobs"]]


def test_prompt_logprobs_match_transformers_even_when_the_prefix_is_cached(
    tiny_model_dir: Callable[[str], Path],
    make_engine: Callable[..., Any],
    oracle: Callable[[str], GreedyOracle],
) -> None:
    # Small chunks, so that the prompt is prefilled in several pieces.
    engine = make_engine(tiny_model_dir("llama"), max_total_tokens=2048, chunked_prefill_size=8)
    prompt = random_prompts(1, [30], seed=33)[0]
    expected = reference_prompt_logprobs(oracle("llama"), prompt)
    # Put the whole prompt in the radix cache first.
    engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 2})

    scored = engine.generate(
        input_ids=prompt,
        sampling_params={**GREEDY, "max_new_tokens": 0},
        return_logprob=True,
        top_logprobs_num=2,
        logprob_start_len=0,
    )
    values = _prompt_values(scored)
    assert values[0] is None and len(values) == len(prompt)
    assert [t for _, t, _ in scored["meta_info"]["input_token_logprobs"]] == prompt
    torch.testing.assert_close(torch.tensor(values[1:]), expected, atol=TOLERANCE, rtol=0)
    assert scored["output_ids"] == [] and scored["meta_info"]["cached_tokens"] == 0
    assert scored["meta_info"]["input_top_logprobs"][0] is None
    assert all(len(top) == 2 for top in scored["meta_info"]["input_top_logprobs"][1:])

    # From position 20 on: the first 19 tokens may come from the cache, the rest are recomputed.
    tail = engine.generate(
        input_ids=prompt,
        sampling_params={**GREEDY, "max_new_tokens": 1},
        return_logprob=True,
        logprob_start_len=20,
    )
    assert tail["meta_info"]["cached_tokens"] == 19
    torch.testing.assert_close(torch.tensor(_prompt_values(tail)), expected[19:], atol=TOLERANCE, rtol=0)
    assert len(tail["meta_info"]["output_token_logprobs"]) == 1
    with pytest.raises(InvalidRequestError, match="logprob_start_len"):
        engine.generate(input_ids=prompt, return_logprob=True, logprob_start_len=30)


def test_named_token_logprobs_at_every_position(engine: Any, oracle: Callable[[str], GreedyOracle]) -> None:
    prompt = random_prompts(1, [10], seed=35)[0]
    named = [3, 17, 42]
    result = engine.generate(
        input_ids=prompt,
        sampling_params={**GREEDY, "max_new_tokens": 4},
        return_logprob=True,
        logprob_start_len=2,
        token_ids_logprob=named,
    )
    meta = result["meta_info"]
    output = reference_logprobs(oracle("llama"), prompt, result["output_ids"])
    for position, triples in enumerate(meta["output_token_ids_logprobs"]):
        assert [t for _, t, _ in triples] == named
        torch.testing.assert_close(
            torch.tensor([v for v, _, _ in triples]), output[position, named], atol=TOLERANCE, rtol=0
        )
    with torch.no_grad():
        logits = oracle("llama").model(input_ids=torch.tensor([prompt])).logits[0].float()
    # Prompt positions 2..9: the logits at position p - 1 score token p.
    prompt_side = torch.log_softmax(logits[1:-1], dim=-1)[:, named]
    values = torch.tensor([[v for v, _, _ in triples] for triples in meta["input_token_ids_logprobs"]])
    torch.testing.assert_close(values, prompt_side, atol=TOLERANCE, rtol=0)
    with pytest.raises(InvalidRequestError, match="token_ids_logprob"):
        engine.generate(input_ids=prompt, return_logprob=True, token_ids_logprob=[10**7])
