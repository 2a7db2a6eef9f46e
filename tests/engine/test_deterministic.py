"""--enable-deterministic-inference: bf16 outputs and logprobs bit-identical whatever else is in the
batch, whether the prefix came from the radix cache, and whatever the chunk size (issue 17's test:
32 prompts in one batch, then each alone, then behind a cached prefix, then with a small chunk)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from radixserve.runtime.engine import Engine

PREFIX = [7, 8, 9, 10, 11, 12, 13, 14] * 4  # 32 tokens every prompt starts with
PROMPTS = [PREFIX + [20 + (i * 13) % 300] + list(range(40, 43 + (i * 7) % 37)) for i in range(32)]


def _params(i: int) -> dict[str, Any]:
    """Greedy for even prompts, seeded sampling (top-p, top-k) for odd ones."""
    if i % 2 == 0:
        return {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    return {
        "max_new_tokens": 24,
        "temperature": 0.9,
        "top_p": 0.95,
        "top_k": 50,
        "seed": i,
        "ignore_eos": True,
    }


def _run(engine: Engine, indices: list[int]) -> dict[int, tuple[list[int], Any]]:
    results = engine.generate(
        input_ids=[PROMPTS[i] for i in indices],
        sampling_params=[_params(i) for i in indices],
        return_logprob=True,
        top_logprobs_num=3,
    )
    assert isinstance(results, list)
    return {
        i: (r["output_ids"], (r["meta_info"]["output_token_logprobs"], r["meta_info"]["output_top_logprobs"]))
        for i, r in zip(indices, results, strict=True)
    }


def test_outputs_and_logprobs_do_not_depend_on_batch_cache_or_chunks(
    tiny_model_dir: Callable[[str], Path], make_engine: Callable[..., Engine]
) -> None:
    model = tiny_model_dir("llama")
    engine = make_engine(model, dtype="bfloat16", enable_deterministic_inference=True)
    everyone = list(range(len(PROMPTS)))
    batched = _run(engine, everyone)
    assert engine.flush_cache()
    alone: dict[int, Any] = {}
    for i in everyone:
        alone |= _run(engine, [i])
        assert engine.flush_cache()
    # The shared prefix (and more) now comes from the radix cache.
    engine.generate(input_ids=PREFIX, sampling_params={"max_new_tokens": 1})
    cached = {}
    for i in everyone:
        cached |= _run(engine, [i])
    chunked_engine = make_engine(
        model, dtype="bfloat16", enable_deterministic_inference=True, chunked_prefill_size=16
    )
    chunked = _run(chunked_engine, everyone[::-1])
    for i in everyone:
        assert alone[i] == batched[i], f"prompt {i}: alone differs from in a batch of 32"
        assert cached[i] == batched[i], f"prompt {i}: behind a cached prefix differs"
        assert chunked[i] == batched[i], f"prompt {i}: with 16-token chunks differs"
