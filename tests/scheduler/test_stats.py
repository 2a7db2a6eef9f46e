"""The scheduler's prefill/decode log lines and the window figures they report."""

from __future__ import annotations

import logging

import pytest

from radixserve.scheduler.stats import SchedulerStats


def test_log_lines_report_cache_hit_rate_itl_and_ttft(caplog: pytest.LogCaptureFixture) -> None:
    stats = SchedulerStats()
    with caplog.at_level(logging.INFO, logger="radixserve.scheduler"):
        stats.log_prefill(new_seq=2, new_tokens=30, cached=10, usage=0.1, running=0, queued=1)
        stats.record_first_token(0.020)
        stats.record_first_token(0.040)
        for _ in range(4):
            stats.record_decode(batch_size=2)
        stats.log_decode(running=2, used_tokens=48, usage=0.2, queued=0)
    prefill, decode = caplog.messages
    assert "#new-token: 30, #cached-token: 10, cache hit rate: 0.25" in prefill
    assert stats.time_to_first_token == pytest.approx(0.030)
    assert "TTFT (ms): 30.0" in decode
    # Four steps in the window: ITL is the window's time per step, throughput its tokens per second.
    assert stats.inter_token_latency > 0
    assert stats.gen_throughput == pytest.approx(8 / (4 * stats.inter_token_latency))
    assert f"ITL (ms): {1000 * stats.inter_token_latency:.1f}" in decode
