"""`radixserve bench multiturn` (bench/multiturn.py) on a tiny random model: each setting runs on
a fresh engine, and L2 (forced beside the CPU pool, as on a GPU) serves returning turns that the
radix cache alone has lost."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from radixserve.cache.host_storage import FORCE_HOST_POOL_ENV
from radixserve_tools.bench.multiturn import MultiTurnWorkload, format_table, run_multiturn_bench

# One request at a time: with a pool of two conversations, each conversation's next turn finds its
# prefix evicted from the device pool (five others ran since) and in L2, whatever the machine's speed.
WORKLOAD = MultiTurnWorkload(
    conversations=6, turns=3, user_tokens=16, reply_tokens=4, concurrency=1, pool_conversations=2,
    context_tokens=48,
)  # fmt: skip


def test_l2_serves_returning_turns_the_radix_cache_lost(
    tiny_model_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FORCE_HOST_POOL_ENV, "1")  # inherited by the engine's processes
    report = run_multiturn_bench(
        WORKLOAD,
        "float32",
        log=lambda _: None,
        engine_args={"hicache_storage_page_size": 16, "hicache_ratio": 16.0},
        settings=("host", "off"),
        model_path=str(tiny_model_dir("llama")),
    )
    off, host = report["rows"]  # in the settings' own order, whatever the order asked
    assert (off["setting"], host["setting"]) == ("off", "host")
    assert off["host_pages_loaded"] == 0 and host["host_pages_loaded"] > 0
    assert host["cached_share"] > off["cached_share"]
    assert "| host |" in format_table(report)


def test_settings_are_checked_before_any_engine_starts() -> None:
    with pytest.raises(ValueError, match="unknown settings"):
        run_multiturn_bench(WORKLOAD, settings=("off", "L3"))
    with pytest.raises(ValueError, match="reads what"):
        run_multiturn_bench(WORKLOAD, settings=("storage, restarted",))
