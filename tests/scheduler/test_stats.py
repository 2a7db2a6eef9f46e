"""The scheduler's prefill/decode log lines and the window figures they report."""

from __future__ import annotations

import logging

import pytest

from radixserve.scheduler.stats import IDLE_GAP_S, HostTimeLine, SchedulerStats


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


def test_the_host_time_line_draws_the_gap_before_each_back_to_back_decode_step() -> None:
    """HostTimeLine: the scheduler's time between one forward's end and the next decode step's
    start, as a line in the step's rows; a prefill's start is not drawn (its host time depends on
    its prompts), nor a decode step after an idle spell."""
    line = HostTimeLine()
    assert line.line() is None and line.describe() == {"steps": 0, "fixed_s": None, "per_row_s": None}
    now = 0.0

    def forward(gap: float, rows: int | None) -> None:
        nonlocal now
        now += gap
        line.forward_started(now, rows)
        now += 0.05  # the forward itself, never drawn
        line.forward_ended(now)

    forward(1.0, 8)  # the first forward: nothing ended before it
    forward(2e-3, None)  # a prefill
    for rows in (8, 4, 2, 1, 8, 4):
        forward(1e-3 + 80e-6 * rows, rows)
    forward(2 * IDLE_GAP_S, 8)  # after the scheduler waited for requests
    assert line.steps == 6
    fixed, per_row = line.line() or (0.0, 0.0)
    assert fixed == pytest.approx(1e-3) and per_row == pytest.approx(80e-6)
    described = line.describe()
    assert described["steps"] == 6 and described["per_row_s"] == pytest.approx(80e-6)
    # One batch size alone cannot split a step's cost from a row's.
    single = HostTimeLine()
    for _ in range(3):
        single.add(4, 1e-3)
    assert single.line() is None
