"""The CUDA path: greedy fp32 on a GPU equals transformers, and two GPUs run --tp-size 2 over NCCL;
the hierarchical cache's L2 host pool (and the file tier beside it) behind a GPU pool. Skipped where
torch sees no CUDA device (every CPU-only CI run); the CPU runs of the same tiers are in
test_storage_tier.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from radixserve.runtime.engine import Engine
from tests.engine.oracle import GREEDY, GreedyOracle, random_prompts
from tests.engine.test_storage_tier import (
    MAX_NEW,
    POOL,
    STORAGE_PAGE,
    _storage_stats,
    _turns,
    _two_turns,
    check_l2_serves_returning_turns,
)
from tests.engine.test_storage_tier import (
    _args as _file_tier_args,
)

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


def test_l2_host_pool_on_cuda_serves_returning_turns(
    tiny_model_dir: Callable[[str], Path],
    oracle: Callable[[str], GreedyOracle],
    make_engine: Callable[..., Engine],
) -> None:
    """L2 of the hierarchical cache where it is meant to run: the device pool on the GPU, evicted
    pages in the host pool. Returning turns are read back from host memory and equal transformers."""
    engine = make_engine(
        tiny_model_dir("llama"),
        device="cuda",
        max_total_tokens=POOL,
        enable_hierarchical_cache=True,
        hicache_storage_page_size=STORAGE_PAGE,
        hicache_ratio=8.0,
    )
    check_l2_serves_returning_turns(engine, oracle("llama"))


def test_l2_and_the_file_tier_on_cuda_survive_a_restart(
    tiny_model_dir: Callable[[str], Path],
    oracle: Callable[[str], GreedyOracle],
    make_engine: Callable[..., Engine],
    tmp_path: Path,
) -> None:
    """Both tiers beside a GPU pool: a new engine on the first one's directory (its L2 empty) serves
    the returning turns from disk, equal to transformers."""
    model, reference = tiny_model_dir("llama"), oracle("llama")
    args = {**_file_tier_args(tmp_path), "device": "cuda", "hicache_ratio": 8.0}
    engine = make_engine(model, **args)
    first, _, second, _ = _two_turns(engine, reference, seed=65, returning=2)
    stats = _storage_stats(engine)
    assert stats["hicache_tier"] == "storage" and stats["hicache_host_pages"] > 0
    engine.check_kv_invariant()
    engine.shutdown()  # its writes are drained on the way out
    after = make_engine(model, **args)
    restarted = _turns(after, second[4:])
    for prompt, previous, result in zip(second[4:], first[4:], restarted, strict=True):
        assert result["output_ids"] == reference.continue_(prompt, MAX_NEW)
        whole_pages = (len(previous) + MAX_NEW - 1) // STORAGE_PAGE * STORAGE_PAGE
        assert result["meta_info"]["cached_tokens"] >= whole_pages
    after.check_kv_invariant()
