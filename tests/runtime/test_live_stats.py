"""The dashboard's request timings (runtime/live_stats.py): percentiles, windows, recent requests."""

from __future__ import annotations

import pytest

from radixserve.runtime import live_stats
from radixserve.runtime.live_stats import LiveStats, percentiles


def test_percentiles_by_nearest_rank() -> None:
    assert percentiles([]) == {"count": 0, "p50": None, "p90": None, "p99": None}
    values = [float(v) for v in range(1, 101)]
    assert percentiles(values) == {"count": 100, "p50": 51.0, "p90": 91.0, "p99": 100.0}


def test_requests_tokens_and_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(live_stats.time, "monotonic", lambda: clock[0])
    stats = LiveStats()
    stats.submitted("a", 10)
    clock[0] += 0.5
    stats.output("a", 1, 4, None)  # first token: TTFT 500 ms
    clock[0] += 0.2
    stats.output("a", 2, 4, None)  # two tokens 200 ms after: 100 ms each
    stats.output("a", 0, 4, "length")
    snap = stats.snapshot()
    assert snap["latency"]["ttft_ms"]["p50"] == pytest.approx(500)
    assert snap["latency"]["itl_ms"]["count"] == 2 and snap["latency"]["itl_ms"]["p50"] == pytest.approx(100)
    assert snap["latency"]["e2e_ms"]["p50"] == pytest.approx(700)
    assert snap["totals"] == {
        "requests": 1,
        "prompt_tokens": 10,
        "output_tokens": 3,
        "cached_tokens": 4,
        "aborted": 0,
    }
    assert snap["throughput"]["output_tok_s"] == pytest.approx(3 / live_stats.THROUGHPUT_WINDOW_S)
    (recent,) = snap["recent"]
    assert recent["state"] == "finished" and recent["ttft_ms"] == pytest.approx(500)
    # Past the windows: no throughput, no latencies; the request stays among the recent ones.
    clock[0] += live_stats.LATENCY_WINDOW_S + 1
    later = stats.snapshot()
    assert later["throughput"]["output_tok_s"] == 0 and later["latency"]["ttft_ms"]["count"] == 0
    assert later["recent"][0]["rid"] == "a"


def test_only_the_recent_finished_requests_are_kept() -> None:
    stats = LiveStats()
    stats.submitted("running", 3)
    for i in range(live_stats.RECENT_REQUESTS + 10):
        stats.submitted(f"r{i}", 3)
        stats.output(f"r{i}", 1, 0, "abort" if i % 2 else "stop")
    snap = stats.snapshot()
    assert len(snap["recent"]) <= live_stats.RECENT_REQUESTS
    assert snap["recent"][0]["rid"] == f"r{live_stats.RECENT_REQUESTS + 9}"
    assert snap["totals"]["aborted"] == (live_stats.RECENT_REQUESTS + 10) // 2
