"""The storage tier end to end, on a tiny random-weight model in fp32: conversations that outgrow
the device pool many times over, and a restarted engine on the same directory, give the greedy
tokens transformers gives, with the returning turns' prefixes served from disk (cached_tokens)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

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
