"""return_hidden_states (the final hidden state behind each output token) and input_embeds (a
prompt given as vectors), against transformers, under batching, chunking and retraction."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from radixserve.protocol.sampling_params import InvalidRequestError
from radixserve.runtime.engine import Engine
from tests.engine.oracle import GREEDY, GreedyOracle, random_prompts

MAX_NEW = 24


def results(out: Any) -> list[dict[str, Any]]:
    assert isinstance(out, list)
    return out


def test_hidden_states_match_transformers_under_retraction_chunking_and_caching(
    tiny_model_dir: Callable[[str], Path],
    oracle: Callable[[str], GreedyOracle],
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine(
        tiny_model_dir("llama"), max_total_tokens=192, chunked_prefill_size=16, schedule_conservativeness=0.1
    )
    prompts = random_prompts(6, [20, 25, 30, 18, 22, 27], seed=3)
    params = {**GREEDY, "max_new_tokens": MAX_NEW}
    # The first prompt's prefix is cached already: its hidden states must be recomputed anyway.
    engine.generate(input_ids=prompts[0][:15], sampling_params={**params, "max_new_tokens": 1})
    outs = results(engine.generate(input_ids=prompts, sampling_params=params, return_hidden_states=True))
    assert engine.get_stats()["retracted_reqs"] > 0
    model = oracle("llama").model
    for prompt, out in zip(prompts, outs, strict=True):
        assert out["output_ids"] == oracle("llama").continue_(prompt, MAX_NEW)
        # SGLang's shape: every prompt position's state, then one per output token but the last.
        prompt_part, *output_part = out["meta_info"]["hidden_states"]
        assert len(prompt_part) == len(prompt) and len(output_part) == MAX_NEW - 1
        hidden = torch.tensor(prompt_part + output_part)
        with torch.no_grad():
            reference = model.model(torch.tensor([prompt + out["output_ids"]])).last_hidden_state[0]
        torch.testing.assert_close(hidden, reference[: len(prompt) + MAX_NEW - 1], atol=1e-4, rtol=1e-4)
    plain = engine.generate(input_ids=prompts[0], sampling_params=params)
    assert isinstance(plain, dict) and "hidden_states" not in plain["meta_info"]


def test_input_embeds_generate_like_the_token_ids_they_embed(
    tiny_model_dir: Callable[[str], Path],
    oracle: Callable[[str], GreedyOracle],
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine(tiny_model_dir("llama"), max_total_tokens=192, schedule_conservativeness=0.1)
    table = oracle("llama").model.model.embed_tokens.weight.detach()
    prompts = random_prompts(5, [20, 25, 30, 18, 22], seed=4)
    vectors = [table[torch.tensor(p)].tolist() for p in prompts]
    params = {**GREEDY, "max_new_tokens": MAX_NEW, "repetition_penalty": 1.0}
    by_vectors = results(engine.generate(input_embeds=vectors, sampling_params=params))
    assert engine.get_stats()["retracted_reqs"] > 0
    for prompt, out in zip(prompts, by_vectors, strict=True):
        assert out["output_ids"] == oracle("llama").continue_(prompt, MAX_NEW)
        assert out["meta_info"]["prompt_tokens"] == len(prompt)

    # Two prompts of the same length given as different vectors share nothing in the cache, and
    # a prompt of ids is not matched against one given as vectors.
    first, second = prompts[0], prompts[0][:-1] + [prompts[0][-1] + 1]
    before = engine.get_stats()["cached_tokens"]
    one = engine.generate(input_embeds=table[torch.tensor(second)].tolist(), sampling_params=params)
    two = engine.generate(input_ids=first, sampling_params=params)
    assert engine.get_stats()["cached_tokens"] == before
    assert isinstance(one, dict) and isinstance(two, dict)
    assert one["output_ids"] == oracle("llama").continue_(second, MAX_NEW)
    assert two["output_ids"] == oracle("llama").continue_(first, MAX_NEW)


def test_bad_input_embeds_are_refused(
    tiny_model_dir: Callable[[str], Path], make_engine: Callable[..., Engine]
) -> None:
    engine = make_engine(tiny_model_dir("llama"))
    # Penalties look at the output only: the prompt's stand-in ids are no tokens.
    penalized = {"max_new_tokens": 4, "repetition_penalty": 1.3, "frequency_penalty": 0.5}
    out = engine.generate(input_embeds=[[0.1] * 64] * 5, sampling_params=penalized)
    assert isinstance(out, dict) and out["meta_info"]["completion_tokens"] == 4
    for bad, message in [
        ([[0.0] * 3], "vectors of 64 numbers"),
        ([], "vectors of 64 numbers"),
        ([[float("nan")] * 64], "finite"),
    ]:
        with pytest.raises(InvalidRequestError, match=message):
            engine.generate(input_embeds=bad, sampling_params={"max_new_tokens": 2})
    with pytest.raises(InvalidRequestError, match="exactly one of"):
        engine.generate("hi", input_embeds=[[0.0] * 64])
    with pytest.raises(InvalidRequestError, match="prompt logprobs"):
        engine.generate(input_embeds=[[0.0] * 64], return_logprob=True, logprob_start_len=0)
