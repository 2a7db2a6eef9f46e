"""The real Scheduler on the simulator's virtual clock (simulator/simulate.py): every request runs
to its length, the clock is the sum of the forwards, shared prefixes hit the cache, a small pool
retracts, and the outputs (table, JSON, HTML) are written."""

from __future__ import annotations

import dataclasses
import math
import statistics
from pathlib import Path

import pytest

from radixserve.cli import main
from radixserve.models.config import ModelConfig
from radixserve_tools.simulator.hardware import BUILTIN_PROFILES
from radixserve_tools.simulator.model_configs import load_config
from radixserve_tools.simulator.report import charts
from radixserve_tools.simulator.simulate import kv_capacity, simulate
from radixserve_tools.simulator.trace import SyntheticTrace, TraceRequest, ready_times, synthetic
from tests.simulator.test_cost_model import LLAMA_8B

CONFIG = ModelConfig.from_hf_dict(LLAMA_8B)


def test_every_request_runs_and_the_clock_adds_up() -> None:
    trace = synthetic(SyntheticTrace(num_requests=40, input_len=(100, 300), output_len=(5, 30), seed=1))
    result = simulate(CONFIG, BUILTIN_PROFILES["H100"], trace, 20_000)
    assert result.requests == 40
    assert result.output_tokens == sum(r.output_len for r in trace)
    assert result.input_tokens == sum(len(r.input_ids) for r in trace)
    assert result.ttft_ms["count"] == 40 and result.itl_ms["count"] == result.output_tokens - 40
    assert 0 < result.ttft_ms["p50"] <= result.e2e_ms["p50"]
    assert result.retracted_reqs == 0 and result.cache_hit_rate < 0.01


def test_arrivals_wait_for_their_time_and_idle_gaps_are_skipped() -> None:
    trace = synthetic(
        SyntheticTrace(num_requests=20, request_rate=0.5, input_len=(64, 64), output_len=(4, 4))
    )
    result = simulate(CONFIG, BUILTIN_PROFILES["H100"], trace, 20_000)
    # Sparse arrivals: each request runs alone, so its TTFT is one prefill, far below the gaps.
    assert result.ttft_ms["p99"] < 100
    assert result.makespan_s == pytest.approx(trace[-1].arrival_s - trace[0].arrival_s, abs=0.5)


def test_shared_prefixes_and_turns_hit_the_cache() -> None:
    shared = synthetic(
        SyntheticTrace(
            num_requests=64, input_len=(32, 32), output_len=(8, 8), prefix_groups=2, prefix_len=512
        )
    )
    assert simulate(CONFIG, BUILTIN_PROFILES["A100"], shared, 50_000).cache_hit_rate > 0.8
    chats = synthetic(
        SyntheticTrace(
            num_requests=30, request_rate=2, input_len=(64, 64), output_len=(16, 16), turns=3, turn_gap_s=5.0
        )
    )
    # A later turn's prompt is the earlier turn's prompt, its reply (the model's 0s) and more.
    continued = sum(
        b.input_ids[: len(a.input_ids) + a.output_len] == a.input_ids + [0] * a.output_len
        for a in chats
        for b in chats
        if b is not a
    )
    assert continued == 30  # 10 conversations: turn 2 continues turn 1, turn 3 both
    result = simulate(CONFIG, BUILTIN_PROFILES["A100"], chats, 50_000)
    assert result.cache_hit_rate > 0.4


def test_a_small_pool_retracts_and_still_finishes() -> None:
    trace = synthetic(SyntheticTrace(num_requests=24, input_len=(200, 200), output_len=(200, 200)))
    result = simulate(CONFIG, BUILTIN_PROFILES["L4"], trace, 2_000, schedule_conservativeness=0.05)
    assert result.requests == 24 and result.retracted_reqs > 0


def test_zero_cost_executor_measures_only_the_scheduler() -> None:
    trace = synthetic(SyntheticTrace(num_requests=16, input_len=(32, 32), output_len=(8, 8)))
    result = simulate(CONFIG, None, trace, 4_000)
    assert result.makespan_s == 0 and result.requests == 16
    assert len(result.scheduler_step_s) >= 8 and all(s >= 0 for s in result.scheduler_step_s)


def test_kv_capacity_fits_beside_the_weights() -> None:
    h100 = BUILTIN_PROFILES["H100"]
    slots = kv_capacity(CONFIG, h100)
    assert slots * 131072 == pytest.approx(80e9 * 0.88 - 15.0e9, rel=0.01)


def test_cli_writes_table_json_and_html(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "config.json"
    import json

    config.write_text(json.dumps(LLAMA_8B))
    out = tmp_path / "out"
    args = ["simulate", "--model-config", str(config), "--hardware", "H200", "--num-requests", "20",
            "--input-len", "64:128", "--output-len", "4:8", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "| requests | 20 |" in printed and "TTFT p50" in printed
    summary = json.loads((out / "simulation.json").read_text())
    assert summary["requests"] == 20 and summary["output_tok_s"] > 0
    page = (out / "simulation.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and page.count("<svg") == 3
    assert "KV slots" in page and "cache hit rate" in page and "TTFT distribution" in page


def test_report_charts_plot_kv_use_hit_rate_and_ttft() -> None:
    trace = synthetic(SyntheticTrace(num_requests=24, input_len=(64, 128), output_len=(4, 16), seed=3))
    result = simulate(CONFIG, BUILTIN_PROFILES["H100"], trace, 4_000)
    kv, hits, ttft = charts(result)
    kv_axes, hits_axes, ttft_axes = kv.axes[0], hits.axes[0], ttft.axes[0]
    assert [a.get_title() for a in (kv_axes, hits_axes, ttft_axes)] == [
        "KV slots",
        "cache hit rate",
        "TTFT distribution",
    ]
    lines = {str(line.get_label()): line for line in kv_axes.get_lines()}
    assert set(lines) == {"in use", "evictable cache"}
    # Short enough to keep every point: the lines are the timeline's, on a pool-sized y axis.
    assert len(result.kv_timeline) > 1
    assert list(lines["in use"].get_xdata()) == [t for t, _, _ in result.kv_timeline]
    assert list(lines["in use"].get_ydata()) == [float(u) for _, u, _ in result.kv_timeline]
    assert list(lines["evictable cache"].get_ydata()) == [float(c) for _, _, c in result.kv_timeline]
    assert kv_axes.get_ylim() == (0.0, float(result.max_total_tokens))
    (hit_line,) = hits_axes.get_lines()
    assert list(hit_line.get_ydata()) == [rate for _, rate in result.hit_timeline]
    (ttft_line,) = ttft_axes.get_lines()
    assert sorted(ttft_line.get_xdata()) == sorted(result.ttft_values_ms) and ttft_line.get_ydata()[-1] == 1.0


def test_cli_takes_a_built_in_model_shape_and_refuses_an_unknown_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["simulate", "--hardware", "H100", "--num-requests", "4", "--input-len", "32", "--output-len", "2"]
    assert main([*args, "--model-config", "llama-3.1-8b"]) == 0
    assert "| requests | 4 |" in capsys.readouterr().out
    assert load_config("Llama-3.1-8B") == CONFIG
    # A usage error is one line and argparse's exit code, not a traceback.
    for wrong in (["--model-config", str(tmp_path / "missing.json")], ["--model-config", "llama-9"]):
        with pytest.raises(SystemExit) as exit_info:
            main([*args, *wrong])
        assert exit_info.value.code == 2
        assert "neither a built-in shape (llama-3.1-8b, " in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*args, "--hardware", "B300", "--model-config", "llama-3.1-8b"])
    assert "neither a built-in profile (H100, " in capsys.readouterr().err


def test_a_cascade_backend_reads_a_shared_prefix_once_per_batch() -> None:
    """One group sharing a 2,048-token prefix: the recorded forwards count the K/V reads a cascade
    saves (decode steps and the later prompts' prefills), and only a cascade profile charges less."""
    trace = synthetic(
        SyntheticTrace(
            num_requests=32, input_len=(16, 16), output_len=(16, 16), prefix_groups=1, prefix_len=2048
        )
    )
    per_request = BUILTIN_PROFILES["A100"]
    cascade = dataclasses.replace(per_request, cascade_attention=True)
    plain = simulate(CONFIG, per_request, trace, 100_000)
    once = simulate(CONFIG, cascade, trace, 100_000)
    decode_steps = [r for r in once.records if r.shape.decode and len(r.shape.q_lens) > 1]
    assert decode_steps and all(
        r.shape.shared_kv_reads >= (len(r.shape.q_lens) - 1) * 2048 for r in decode_steps
    )
    # Every query of a step attends the shared prefix: in one call for all, with a cascade.
    assert all(r.shape.shared_pairs >= len(r.shape.q_lens) * 2048 for r in decode_steps)
    assert all(r.shape.shared_prefix_tokens >= 2048 for r in decode_steps)
    later = [r for r in once.records if not r.shape.decode and min(r.shape.prefix_lens) >= 2048]
    assert later and all(r.shape.shared_pairs == 2048 * sum(r.shape.q_lens) for r in later)
    # Which requests the cascade attends: every one of those prefills.
    assert all(r.shape.cascade_requests == tuple(range(len(r.shape.q_lens))) for r in later)
    # A profile without a cascade does not look for shared prefixes (host time saved); the batches
    # are the same either way.
    assert all(r.shape.shared_kv_reads == 0 for r in plain.records)
    strip = [dataclasses.replace(r.shape, shared_prefixes=(), cascade_requests=()) for r in once.records]
    assert [r.shape for r in plain.records] == strip
    assert once.makespan_s < plain.makespan_s
    # Requests that share nothing save nothing.
    apart = synthetic(SyntheticTrace(num_requests=8, input_len=(64, 64), output_len=(8, 8)))
    assert all(r.shape.shared_kv_reads == 0 for r in simulate(CONFIG, cascade, apart, 100_000).records)


def test_an_idle_scheduler_takes_every_request_that_arrived_before_it_woke() -> None:
    """Arrivals 0.1 ms apart, then one at 1 ms: simulated at their arrivals, the first request runs
    alone; with the recorded server's receipt (the idle scheduler took the first three at once,
    0.5 ms after the first arrived), the first batch holds those three, as the server's did."""
    prompts = [[i + 1] * 256 for i in range(4)]
    arrivals = [0.0, 1e-4, 2e-4, 1e-3]
    at_arrival = [TraceRequest(t, p, 4) for t, p in zip(arrivals, prompts, strict=True)]
    received = [
        TraceRequest(t, p, 4, 5e-4 if t < 5e-4 else None) for t, p in zip(arrivals, prompts, strict=True)
    ]
    alone = simulate(CONFIG, BUILTIN_PROFILES["H100"], at_arrival, 20_000)
    together = simulate(CONFIG, BUILTIN_PROFILES["H100"], received, 20_000)
    assert alone.records[0].shape.q_lens == [256]
    assert together.records[0].shape.q_lens == [256, 256, 256]
    # TTFT still counts from the arrival: the receipt delay is part of it.
    assert min(together.ttft_values_ms) > 0.5 - 0.1


def test_a_request_the_idle_scheduler_missed_waits_for_its_next_step() -> None:
    """The engine stamped the third request's arrival before the idle scheduler woke, but the
    scheduler took only the first two then, and the third between its steps (received_busy_s): the
    simulation's first batch holds two, as the server's did, and the third comes right after."""
    prompts = [[i + 1] * 256 for i in range(3)]
    trace = [
        TraceRequest(0.0, prompts[0], 4, 5e-4),
        TraceRequest(1e-4, prompts[1], 4, 5e-4),
        TraceRequest(2e-4, prompts[2], 4, None, 0.05),
    ]
    assert ready_times(trace)[:2] == [5e-4, 5e-4] and 5e-4 < ready_times(trace)[2] < 5e-4 + 1e-9
    # One the busy scheduler took with no idle receipt since its arrival is ready on arrival.
    late = TraceRequest(6e-4, prompts[2], 4, None, 0.05)
    assert ready_times([*trace[:2], late])[2] == 6e-4
    result = simulate(CONFIG, BUILTIN_PROFILES["H100"], trace, 20_000)
    assert result.records[0].shape.q_lens == [256, 256]
    assert result.records[1].shape.q_lens == [256] and not result.records[1].shape.decode


def test_a_forward_after_an_idle_spell_pays_the_wake_cost() -> None:
    """The first forward after the device idled costs idle_wake_s more (a shorter idle than
    idle_wake_after_s, its share); a forward right after another, or at the clock's start, none."""
    profile = dataclasses.replace(BUILTIN_PROFILES["H100"], idle_wake_s=0.02, idle_wake_after_s=1.0)
    prompt = list(range(64))
    alone = simulate(CONFIG, profile, [TraceRequest(0.0, prompt, 1)], 20_000)
    extend = alone.records[0].seconds
    assert alone.records[0].idle_s == 0.0
    trace = [TraceRequest(0.0, prompt, 1), TraceRequest(5.0, prompt[:32], 1)]
    trace.append(TraceRequest(5.5, prompt[:16], 1))
    result = simulate(CONFIG, profile, trace, 20_000)
    first, long_idle, short_idle = result.records
    assert first.seconds == extend
    assert long_idle.idle_s == pytest.approx(5.0 - extend)
    assert short_idle.idle_s == pytest.approx(0.5 - long_idle.seconds)
    # Against the same trace without a wake cost:
    without = dataclasses.replace(profile, idle_wake_s=0.0)
    bare = simulate(CONFIG, without, trace, 20_000).records
    assert long_idle.seconds - bare[1].seconds == pytest.approx(0.02)
    assert short_idle.seconds - bare[2].seconds == pytest.approx(0.02 * short_idle.idle_s)


def test_a_noisy_profile_draws_each_forwards_time_around_the_roofline() -> None:
    """forward_noise: each forward's time is drawn around the roofline's (the mean kept), the same
    for the same seed; a run of many forwards keeps its total."""
    trace = synthetic(SyntheticTrace(num_requests=30, input_len=(100, 300), output_len=(20, 40), seed=2))
    quiet = BUILTIN_PROFILES["H100"]
    noisy = dataclasses.replace(quiet, forward_noise=0.1)
    base = simulate(CONFIG, quiet, trace, 20_000)
    again, other = simulate(CONFIG, noisy, trace, 20_000), simulate(CONFIG, noisy, trace, 20_000, seed=1)
    assert simulate(CONFIG, noisy, trace, 20_000).records == again.records
    assert again.records != other.records
    # All arrive at once: the batches do not depend on time, only each forward's cost does.
    assert [r.shape for r in again.records] == [r.shape for r in base.records]
    ratios = [n.seconds / b.seconds for n, b in zip(again.records, base.records, strict=True)]
    logs = [math.log(r) for r in ratios]
    assert statistics.pstdev(logs) == pytest.approx(0.1, rel=0.25)
    assert again.makespan_s == pytest.approx(base.makespan_s, rel=0.05)
