"""`radixserve bench soak`: the plan and the checks offline, then a short soak against a live
tiny-llama server with a KV pool small enough that requests get retracted."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from radixserve.cli import build_parser
from radixserve_tools.bench.soak import plan, run_soak
from radixserve_tools.bench.soak_report import (
    KIND_WEIGHTS,
    Result,
    SoakConfig,
    build_report,
    format_report,
    process_tree,
    sample_rss,
)
from tests.server.conftest import finish, launch

IDLE_OK = {"idle": True, "kv_invariant": "ok", "retracted_reqs": 0, "aborted_reqs": 0}


def test_plan_is_seeded_and_adds_up() -> None:
    config = SoakConfig(num_requests=2000, seed=7)
    first, again = plan(config), plan(config)
    assert [(k, s) for k, _, s in first] == [(k, s) for k, _, s in again]
    assert sum(size for _, _, size in first) == 2000
    assert set(KIND_WEIGHTS) == {kind for kind, _, _ in first}
    other = plan(SoakConfig(num_requests=2000, seed=8))
    assert [k for k, _, _ in other] != [k for k, _, _ in first]


def test_checks_fail_on_5xx_transport_errors_and_kv_leaks() -> None:
    ok = [Result("native", "ok", latency_s=0.1), Result("disconnect_stream", "client_disconnected")]
    report = build_report(SoakConfig(), "m", ok, 1.0, IDLE_OK, IDLE_OK, {})
    assert report.passed and report.rss_growth is None
    assert "RSS" not in " ".join(report.checks)  # not measured without --server-pid
    bad = [*ok, Result("chat", "5xx", 500), Result("native", "transport_error", 0, error="reset")]
    leaked = {**IDLE_OK, "kv_invariant": "violated: 3 slots"}
    report = build_report(SoakConfig(), "m", bad, 1.0, IDLE_OK, leaked, {})
    assert not report.checks["no 5xx"] and not report.checks["no transport errors"]
    assert not report.checks["kv_invariant ok"] and not report.passed
    assert report.by_status == {"500": 1}
    assert "FAIL" in format_report(report)
    rss = {"start": {"total": 100}, "third": {"total": 100}, "end": {"total": 106}}
    report = build_report(SoakConfig(), "m", ok, 1.0, IDLE_OK, IDLE_OK, rss)
    assert report.rss_growth is not None and abs(report.rss_growth - 0.06) < 1e-9 and not report.passed


def test_rss_of_a_process_tree() -> None:
    assert process_tree(os.getpid())[0] == os.getpid()
    sample = sample_rss(os.getpid())
    assert sample["total"] > 0 and sample[str(os.getpid())] > 0


def test_cli_parses_soak_flags() -> None:
    args = build_parser().parse_args(
        ["bench", "soak", "--base-url", "http://127.0.0.1:1", "--num-requests", "5", "--server-pid", "42"]
    )
    assert (args.num_requests, args.concurrency, args.server_pid, args.seed) == (5, 16, 42, 1)


def test_short_soak_against_a_live_server(tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    """~500 requests of the whole mix with a 256-token KV pool: every check passes (RSS included:
    it grows well under 1% here), and the run retracts, aborts and sees clients hang up."""
    server = launch(tiny_model_dir("llama"), tmp_path / "server", "--max-total-tokens", "256")
    try:
        out = tmp_path / "soak.json"
        config = SoakConfig(
            base_url=server.base_url,
            num_requests=500,
            concurrency=16,
            seed=3,
            server_pid=server.process.pid,
            max_tokens=48,
            # No latency bound: a slow or busy machine must not fail the test.
            request_timeout=600,
            out=str(out),
            disable_tqdm=True,
        )
        start = time.perf_counter()
        report = asyncio.run(run_soak(config))
        print(format_report(report), f"\nsoak wall time {time.perf_counter() - start:.1f} s")
        assert report.passed, format_report(report)
        assert report.requests == 500
        assert report.server_retracted > 0, "the KV pool is meant to be small enough to retract"
        assert report.server_aborted > 0 and report.outcomes["aborted"] > 0
        assert report.outcomes["client_disconnected"] > 0 and report.outcomes["expected_4xx"] > 0
        assert report.outcomes["5xx"] == 0 and report.outcomes["transport_error"] == 0
        assert report.kv_invariant == "ok" and report.idle
        assert report.rss_growth is not None  # measured (the check itself is among report.checks)
        assert len(report.rss_kb["start"]) >= 3  # the server and its children, plus the total
        kinds = Counter({k: sum(v.values()) for k, v in report.by_kind.items()})
        assert set(kinds) == set(KIND_WEIGHTS)
        written = json.loads(out.read_text())
        assert written["passed"] is True and written["outcomes"] == report.outcomes
    finally:
        finish(server)
