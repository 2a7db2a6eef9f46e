"""--enable-deterministic-inference: bf16 outputs and logprobs bit-identical whatever else is in the
batch, whether the prefix came from the radix cache, and whatever the chunk size (issue 17's test:
32 prompts in one batch, then each alone, then behind a cached prefix, then with a small chunk)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from radixserve.runtime.engine import Engine
from tests.gguf_fixture import write_gguf

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


# Every linear of the tiny Qwen3-MoE in Q8_0 blocks, its LM head and experts included (the router and
# norms stay F32): with fp32 activations, every matmul then runs on a row-invariant kernel.
MOE_IN_BLOCKS = dict.fromkeys(
    ["token_embd", "output", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]
    + ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"],
    "Q8_0",
)


@pytest.mark.parametrize(
    ("arch", "dtype"), [("llama", "bfloat16"), ("gemma3", "bfloat16"), ("qwen3_moe", "float32")]
)
def test_outputs_and_logprobs_do_not_depend_on_batch_cache_or_chunks(
    tiny_model_dir: Callable[[str], Path],
    make_engine: Callable[..., Engine],
    tmp_path: Path,
    arch: str,
    dtype: str,
) -> None:
    """Gemma 3's sliding layers (a 12-token window, prompts of 33-70 tokens) read their windows
    through the same fixed pieces of the decode kernel, in extend as in decode; Qwen3-MoE (a GGUF
    of Q8_0 blocks) runs its experts on the row-invariant quantized kernel, routed on the native
    fp32 router."""
    model = tiny_model_dir(arch)
    if arch == "qwen3_moe":
        model = write_gguf(model, tmp_path / "qwen3moe.gguf", MOE_IN_BLOCKS)
    engine = make_engine(model, dtype=dtype, enable_deterministic_inference=True)
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
        model, dtype=dtype, enable_deterministic_inference=True, chunked_prefill_size=16
    )
    chunked = _run(chunked_engine, everyone[::-1])
    for i in everyone:
        assert alone[i] == batched[i], f"prompt {i}: alone differs from in a batch of 32"
        assert cached[i] == batched[i], f"prompt {i}: behind a cached prefix differs"
        assert chunked[i] == batched[i], f"prompt {i}: with 16-token chunks differs"
