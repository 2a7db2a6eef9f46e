"""The CUDA path: greedy fp32 on a GPU equals transformers, and two GPUs run --tp-size 2 over NCCL.
Skipped where torch sees no CUDA device (every CPU-only CI run)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from radixserve.runtime.engine import Engine
from tests.engine.oracle import GREEDY, GreedyOracle, random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("tp_size", [1, 2])
def test_greedy_on_cuda_matches_transformers(
    tp_size: int,
    tiny_model_dir: Callable[[str], Path],
    oracle: Callable[[str], GreedyOracle],
    make_engine: Callable[..., Engine],
) -> None:
    if torch.cuda.device_count() < tp_size:
        pytest.skip(f"needs {tp_size} CUDA devices")
    engine = make_engine(tiny_model_dir("llama"), device="cuda", tp_size=tp_size, chunked_prefill_size=16)
    prompts = random_prompts(16, seed=40)
    results = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 12})
    assert isinstance(results, list)
    for prompt, res in zip(prompts, results, strict=True):
        assert res["output_ids"] == oracle("llama").continue_(prompt, 12)
    assert engine.get_stats()["overlap_schedule"] is True
