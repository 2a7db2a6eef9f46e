"""Calibration (simulator/calibrate.py): the fit recovers a known profile from times it predicts,
and the whole path runs on a real engine and writes a profile simulate can load."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from radixserve.models.config import ModelConfig
from radixserve.runtime.engine import Engine
from radixserve.simulator.calibrate import (
    CALIBRATION_RUNS,
    Run,
    fit,
    forward_costs,
    prompts,
    recorded_forwards,
)
from radixserve.simulator.cli import calibrate_engine
from radixserve.simulator.cost_model import ForwardShape, ModelShape, forward_seconds
from radixserve.simulator.executor import SIM_VOCAB
from radixserve.simulator.hardware import HardwareProfile, load_profile
from radixserve.simulator.trace import TraceRequest
from tests.simulator.test_cost_model import LLAMA_8B


def _fit_to(truth: HardwareProfile) -> tuple[HardwareProfile, list[float], list[float]]:
    """The profile fitted to the calibration runs' times as `truth` predicts them; those times, and
    the fitted profile's predictions of them."""
    config = ModelConfig.from_hf_dict(LLAMA_8B)
    recorded = [
        recorded_forwards(
            config, [TraceRequest(0.0, p, shape[2]) for p in prompts(shape, SIM_VOCAB, i)], 200_000
        )
        for i, shape in enumerate(CALIBRATION_RUNS)
    ]
    shape = ModelShape.of(config)
    times = [sum(forward_seconds(shape, truth, f.shape) for f in forwards) for forwards in recorded]
    runs = [Run(*run, time) for run, time in zip(CALIBRATION_RUNS, times, strict=True)]
    costs = [forward_costs(config, r) for r in recorded]
    fitted = fit(config, runs, costs, truth.peak_flops, truth.memory_bandwidth, truth.memory_bytes)
    predicted = [sum(forward_seconds(shape, fitted, f.shape) for f in forwards) for forwards in recorded]
    return fitted, times, predicted


def test_the_fit_recovers_a_cpu_like_profile() -> None:
    """An 8B model on a slow device: a 32-request decode step is compute-bound, which shows its
    linears' own efficiency."""
    truth = HardwareProfile(
        "truth", 2e12, 1e11, 6e10, 0.36, 0.62, 2e-3, attention_efficiency=0.05, decode_flops_efficiency=0.5
    )
    fitted, times, predicted = _fit_to(truth)
    assert predicted == pytest.approx(times, rel=0.02)  # the pattern search refines the grid
    assert fitted.flops_efficiency == pytest.approx(0.36, rel=0.1), fitted
    assert fitted.bandwidth_efficiency == pytest.approx(0.62, rel=0.1), fitted
    assert fitted.decode_flops_efficiency == pytest.approx(0.5, rel=0.1), fitted


def test_the_fit_recovers_a_host_bound_profile() -> None:
    """The same model on a device fast enough that a decode step's fixed costs (per step and per
    row) show: told apart from a prefill forward's."""
    truth = HardwareProfile(
        "truth",
        2e14,
        2e12,
        6e10,
        0.4,
        0.8,
        2e-3,
        attention_efficiency=0.2,
        decode_overhead_s=20e-3,
        row_overhead_s=200e-6,
    )
    fitted, times, predicted = _fit_to(truth)
    assert predicted == pytest.approx(times, rel=0.02)
    # A decode step reads the same weights at every batch size, so its fixed cost and the
    # weights' bandwidth cannot be told apart, only their sum: a decode step's time.
    shape = ModelShape.of(ModelConfig.from_hf_dict(LLAMA_8B))
    for rows in (1, 8, 32):
        step = ForwardShape([1] * rows, [100] * rows, rows, decode=True)
        assert forward_seconds(shape, fitted, step) == pytest.approx(
            forward_seconds(shape, truth, step), rel=0.02
        )
    assert fitted.row_overhead_s == pytest.approx(200e-6, rel=0.2), fitted
    assert fitted.forward_overhead_s < 5e-3, fitted


def test_calibrate_a_real_engine(tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    engine = Engine(str(tiny_model_dir("llama")), dtype="float32", max_total_tokens=4096, log_level="warning")
    try:
        profile, rows = calibrate_engine(engine, name="this-cpu")
        engine.check_kv_invariant()
    finally:
        engine.shutdown()
    assert len(rows) == len(CALIBRATION_RUNS)
    assert profile.peak_flops > 0 and profile.memory_bandwidth > 0 and profile.memory_bytes > 0
    assert all(run.seconds > 0 and predicted > 0 for run, predicted in rows)
    path = tmp_path / "cpu.json"
    profile.save(path)
    assert load_profile(str(path)) == profile
