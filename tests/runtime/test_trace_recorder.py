"""TraceRecorder (--record-trace): which finished requests become lines, what a line holds, and
that its writer thread never lets a failing disk reach the engine."""

from __future__ import annotations

import json
import logging
import stat
from pathlib import Path

import pytest

from radixserve.config.server_args import InvalidArgumentError
from radixserve.protocol.messages import FinishReason
from radixserve.runtime.trace_recorder import TraceRecorder
from radixserve_tools.simulator.trace import load_trace


def _lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_finished_requests_become_lines_the_simulator_loads(tmp_path: Path) -> None:
    path = tmp_path / "new" / "dir" / "trace.jsonl"
    recorder = TraceRecorder(str(path))
    recorder.start()
    recorder.submitted("a", [5, 6, 7], 3)
    recorder.submitted("vectors", [], 4)  # a prompt of input_embeds: no ids
    recorder.submitted("refused", [1, 2], 2)
    recorder.submitted("late", [9], 1)
    recorder.submitted("gone", [3], 1)
    recorder.forget("gone")  # refused by the engine before it reached the scheduler
    recorder.finished("vectors", 2, FinishReason("stop", matched=0))
    recorder.finished("a", 4, FinishReason("length"))
    recorder.finished("refused", 0, FinishReason("abort", message="bad grammar", status_code=400))
    recorder.finished("late", 1, FinishReason("abort", message="timed out", status_code=503))
    recorder.finished("gone", 1, FinishReason("stop"))
    recorder.finished("never-submitted", 1, FinishReason("stop"))
    recorder.close()

    rows = _lines(path)
    assert [r.get("input_ids") for r in rows] == [None, [5, 6, 7], [9]]  # in finishing order
    assert [(r["input_len"], r["output_len"], r["finish"]) for r in rows] == [
        (4, 2, "stop"),
        (3, 4, "length"),
        (1, 1, "abort"),  # a timeout is load the server carried, unlike a refusal
    ]
    arrivals = [r["arrival_s"] for r in rows]
    assert all(isinstance(a, float) and 0 <= a < 5 for a in arrivals)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # a log of users' prompts
    trace = load_trace(path)
    assert sorted(len(r.input_ids) for r in trace) == [1, 3, 4]


def test_a_restarted_server_appends(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    for rid in ("first", "second"):
        recorder = TraceRecorder(str(path))
        recorder.start()
        recorder.submitted(rid, [1], 1)
        recorder.finished(rid, 1, FinishReason("stop"))
        recorder.close()
    assert len(_lines(path)) == 2


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_full_disk_stops_the_trace_not_the_engine(caplog: pytest.LogCaptureFixture) -> None:
    recorder = TraceRecorder("/dev/full")  # every write fails with ENOSPC
    recorder.start()
    with caplog.at_level(logging.ERROR):
        for i in range(3):
            recorder.submitted(str(i), [1], 1)
            recorder.finished(str(i), 1, FinishReason("stop"))
        recorder.close()
    assert sum("stopped recording the request trace" in r.message for r in caplog.records) == 1


def test_a_path_that_cannot_be_appended_to_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="--record-trace"):
        TraceRecorder(str(tmp_path))  # a directory


def test_a_recorder_never_started_closes(tmp_path: Path) -> None:
    """An engine whose start failed closes its recorder without a writer thread."""
    TraceRecorder(str(tmp_path / "trace.jsonl")).close()


def test_when_the_scheduler_took_a_request_is_recorded_and_loaded(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    recorder = TraceRecorder(str(path))
    recorder.start()
    recorder.submitted("idle", [1, 2], 2)
    recorder.submitted("busy", [3], 1)
    recorder.submitted("unseen", [4], 1)
    # The scheduler's clock is time.monotonic(), as the recorder's: 20 and 90 ms after it started.
    recorder.received("idle", recorder._started + 0.020, idle=True, first_output_at=recorder._started + 0.07)
    recorder.received("busy", recorder._started + 0.090, idle=False)
    recorder.received("unknown", recorder._started + 0.5, idle=True)  # not submitted here: ignored
    for rid in ("idle", "busy", "unseen"):
        recorder.finished(rid, 1, FinishReason("length"))
    recorder.close()
    rows = {tuple(r["input_ids"]): r for r in _lines(path)}  # type: ignore[arg-type]
    assert rows[(1, 2)]["received_s"] == pytest.approx(0.020) and "received_busy_s" not in rows[(1, 2)]
    assert rows[(3,)]["received_busy_s"] == pytest.approx(0.090) and "received_s" not in rows[(3,)]
    assert "received_s" not in rows[(4,)] and "received_busy_s" not in rows[(4,)]
    # The scheduler-side first output, where the scheduler sent one.
    assert rows[(1, 2)]["first_output_s"] == pytest.approx(0.07) and "first_output_s" not in rows[(3,)]
    loaded = {tuple(r.input_ids): r for r in load_trace(path)}
    assert loaded[(1, 2)].received_s == pytest.approx(0.020) and loaded[(1, 2)].received_busy_s is None
    assert loaded[(3,)].received_busy_s == pytest.approx(0.090) and loaded[(3,)].received_s is None
