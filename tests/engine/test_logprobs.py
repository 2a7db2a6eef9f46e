"""Output logprobs equal log_softmax of transformers' logits on the same weights (fp32, 1e-4)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from radixserve.sampling_params import InvalidRequestError
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
