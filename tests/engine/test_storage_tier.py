"""The storage tier end to end, on a tiny random-weight model in fp32: conversations that outgrow
the device pool many times over, and a restarted engine on the same directory, give the greedy
tokens transformers gives, with the returning turns' prefixes served from disk (cached_tokens);
so do a STANDALONE draft model over loaded prefixes, two tensor-parallel ranks, and L2 (the CUDA
path's host pool, forced beside the CPU pool)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from radixserve.cache.host_storage import FORCE_HOST_POOL_ENV
from tests.engine.oracle import GREEDY, GreedyOracle, random_prompts

MAX_NEW = 12
POOL = 160  # device KV slots: a conversation and a half
STORAGE_PAGE = 16


def _args(directory: Path) -> dict[str, Any]:
    return {
        "max_total_tokens": POOL,
        "enable_hierarchical_cache": True,
        "hicache_storage_backend": "file",
        "hicache_storage_dir": str(directory),
        "hicache_storage_page_size": STORAGE_PAGE,
    }


def _turns(engine: Any, prompts: list[list[int]]) -> list[dict[str, Any]]:
    """One request at a time, as a chat's turns arrive."""
    params = {**GREEDY, "max_new_tokens": MAX_NEW}
    return [engine.generate(input_ids=prompt, sampling_params=params) for prompt in prompts]


Turns = tuple[list[list[int]], list[dict[str, Any]], list[list[int]], list[dict[str, Any]]]


def _two_turns(engine: Any, reference: GreedyOracle, seed: int, returning: int) -> Turns:
    """Eight conversations' first turns, then the second turns of the first `returning` of them,
    each equal to transformers: (first prompts, their results, second prompts, their results)."""
    first = random_prompts(8, [70, 90, 60, 100, 80, 75, 95, 85], seed=seed)
    first_out = _turns(engine, first)
    second = [[*p, *r["output_ids"], 5, 6, 7] for p, r in zip(first, first_out, strict=True)]
    again = _turns(engine, second[:returning])
    for prompt, result in zip(first + second[:returning], first_out + again, strict=True):
        assert result["output_ids"] == reference.continue_(prompt, MAX_NEW)
    return first, first_out, second, again


def _storage_stats(engine: Any) -> dict[str, Any]:
    payload: dict[str, Any] = engine.control("get_stats").payload
    return payload


def test_returning_turns_after_a_restart_come_from_storage_and_equal_transformers(
    tmp_path: Path,
    tiny_model_dir: Callable[[str], Path],
    oracle: Callable[[str], GreedyOracle],
    make_engine: Callable[..., Any],
) -> None:
    model, reference = tiny_model_dir("llama"), oracle("llama")
    first = random_prompts(12, [70, 90, 60, 100, 80, 75, 95, 85, 65, 92, 78, 88], seed=61)
    before = make_engine(model, **_args(tmp_path))
    first_out = _turns(before, first)
    for prompt, result in zip(first, first_out, strict=True):
        assert result["output_ids"] == reference.continue_(prompt, MAX_NEW)
    second = [[*p, *r["output_ids"], 5, 6, 7] for p, r in zip(first, first_out, strict=True)]
    # Both turns together hold more than ten times the device pool.
    assert sum(len(p) + MAX_NEW for p in first + second) > 10 * POOL
    # The same engine: the pool held the last conversation or so, the rest come back from disk.
    again = _turns(before, second[:4])
    for prompt, result in zip(second[:4], again, strict=True):
        assert result["output_ids"] == reference.continue_(prompt, MAX_NEW)
    stats = _storage_stats(before)
    assert stats["hicache_tier"] == "storage" and stats["hicache_storage_hit_tokens"] > 0
    assert stats["hicache_storage_pages_written"] > 0 and stats["hicache_storage_bytes_read"] > 0
    before.check_kv_invariant()
    before.shutdown()  # its writes are drained on the way out

    after = make_engine(model, **_args(tmp_path))
    restarted = _turns(after, second)
    for prompt, previous, result in zip(second, first, restarted, strict=True):
        assert result["output_ids"] == reference.continue_(prompt, MAX_NEW)
        # The first turn's whole pages came from the first engine's files.
        whole_pages = (len(previous) + MAX_NEW - 1) // STORAGE_PAGE * STORAGE_PAGE
        assert result["meta_info"]["cached_tokens"] >= whole_pages
    assert _storage_stats(after)["hicache_storage_hit_tokens"] >= sum(len(p) for p in first) // 2


def test_a_draft_model_drafts_over_prefixes_loaded_from_storage(
    tmp_path: Path,
    tiny_model_dir: Callable[[str], Path],
    oracle: Callable[[str], GreedyOracle],
    make_engine: Callable[..., Any],
) -> None:
    """STANDALONE with the storage tier: a loaded prefix brings the target's K/V only, and the
    draft model (here the target itself, so its drafts are right) computes its own over it again.
    Outputs equal transformers', and the drafts over loaded prefixes are still accepted."""
    model, reference = tiny_model_dir("llama"), oracle("llama")
    engine = make_engine(
        model,
        **_args(tmp_path),
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path=str(model),
        speculative_num_steps=3,
        disable_speculative_adaptive=True,  # what the gate drafts depends on this machine's speed
    )
    _two_turns(engine, reference, seed=62, returning=4)
    stats = _storage_stats(engine)
    assert stats["hicache_storage_hit_tokens"] >= 4 * STORAGE_PAGE * 3
    assert stats["spec_accepted_tokens"] >= 0.8 * stats["spec_draft_tokens"] > 0
    engine.check_kv_invariant()


def test_two_tensor_parallel_ranks_store_and_load_their_own_pages(
    tmp_path: Path,
    tiny_model_dir: Callable[[str], Path],
    oracle: Callable[[str], GreedyOracle],
    make_engine: Callable[..., Any],
) -> None:
    """--tp-size 2: each rank keeps its own heads' pages (a fingerprint directory each), the ranks
    agree on what they load, and the returning turns, in the same engine and after a restart,
    equal transformers with their prefixes from disk."""
    model, reference = tiny_model_dir("llama"), oracle("llama")
    before = make_engine(model, tp_size=2, **_args(tmp_path))
    first, _, second, _ = _two_turns(before, reference, seed=63, returning=3)
    assert _storage_stats(before)["hicache_storage_hit_tokens"] >= 3 * STORAGE_PAGE * 3
    before.check_kv_invariant()
    before.shutdown()
    fingerprints = [d for d in tmp_path.iterdir() if d.is_dir()]
    assert len(fingerprints) == 2, "one directory of pages per rank"
    assert all(any(d.glob("*/*.kv")) for d in fingerprints)

    after = make_engine(model, tp_size=2, **_args(tmp_path))
    restarted = _turns(after, second[3:])
    for prompt, previous, result in zip(second[3:], first[3:], restarted, strict=True):
        assert result["output_ids"] == reference.continue_(prompt, MAX_NEW)
        whole_pages = (len(previous) + MAX_NEW - 1) // STORAGE_PAGE * STORAGE_PAGE
        assert result["meta_info"]["cached_tokens"] >= whole_pages
    after.check_kv_invariant()


def test_l2_host_pool_forced_on_a_cpu_serves_returning_turns(
    tiny_model_dir: Callable[[str], Path],
    oracle: Callable[[str], GreedyOracle],
    make_engine: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The CUDA path's L2 host pool (--enable-hierarchical-cache without a storage backend), forced
    beside the CPU device pool: returning turns read back from host memory equal transformers."""
    monkeypatch.setenv(FORCE_HOST_POOL_ENV, "1")  # inherited by the engine's processes
    model, reference = tiny_model_dir("llama"), oracle("llama")
    engine = make_engine(
        model,
        max_total_tokens=POOL,
        enable_hierarchical_cache=True,
        hicache_storage_page_size=STORAGE_PAGE,
        hicache_ratio=8.0,
    )
    check_l2_serves_returning_turns(engine, reference)


def check_l2_serves_returning_turns(engine: Any, reference: GreedyOracle) -> None:
    """Four conversations return after the pool moved on: their first turns' whole pages come back
    from L2, the outputs equal transformers, and the KV accounting holds (test_cuda.py too)."""
    first, _, _, again = _two_turns(engine, reference, seed=64, returning=4)
    for previous, result in zip(first[:4], again, strict=True):
        whole_pages = (len(previous) + MAX_NEW - 1) // STORAGE_PAGE * STORAGE_PAGE
        assert result["meta_info"]["cached_tokens"] >= whole_pages
    stats = _storage_stats(engine)
    assert stats["hicache_tier"] == "host" and stats["hicache_host_pages_loaded"] > 0
    engine.check_kv_invariant()
