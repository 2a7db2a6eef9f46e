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
from radixserve.simulator.cost_model import ModelShape, forward_seconds
from radixserve.simulator.executor import SIM_VOCAB
from radixserve.simulator.hardware import HardwareProfile, load_profile
from radixserve.simulator.trace import TraceRequest
from tests.simulator.test_cost_model import LLAMA_8B


def test_the_fit_recovers_a_known_profile() -> None:
    config = ModelConfig.from_hf_dict(LLAMA_8B)
    truth = HardwareProfile(
        "truth",
        2e12,
        1e11,
        6e10,
        0.36,
        0.62,
        2e-3,
        attention_efficiency=0.05,
        decode_overhead_s=20e-3,
        row_overhead_s=50e-6,
    )
    recorded = [
        recorded_forwards(
            config, [TraceRequest(0.0, p, shape[2]) for p in prompts(shape, SIM_VOCAB, i)], 200_000
        )
        for i, shape in enumerate(CALIBRATION_RUNS)
    ]
    shape = ModelShape.of(config)
    runs = [
        Run(*run, sum(forward_seconds(shape, truth, f.shape) for f in forwards))
        for run, forwards in zip(CALIBRATION_RUNS, recorded, strict=True)
    ]
    fitted = fit(config, runs, [forward_costs(config, r) for r in recorded], 2e12, 1e11, 6e10)
    predicted = [sum(forward_seconds(shape, fitted, f.shape) for f in forwards) for forwards in recorded]
    for run, time in zip(runs, predicted, strict=True):
        assert time == pytest.approx(run.seconds, rel=0.12)  # the grid's spacing, no more
    assert fitted.bandwidth_efficiency == pytest.approx(0.62, rel=0.2)
    # A decode step's own fixed cost is told apart from a prefill forward's.
    assert fitted.decode_overhead_s is not None
    assert 10e-3 < fitted.decode_overhead_s < 40e-3 and fitted.forward_overhead_s < 5e-3, fitted


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
