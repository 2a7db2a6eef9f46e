"""Calibration (simulator/calibrate.py): the fit recovers a known profile from times it predicts,
and the whole path runs on a real engine and writes a profile simulate can load."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from radixserve.models.config import ModelConfig
from radixserve.models.source import load_model_config, resolve_model_source
from radixserve.runtime.engine import Engine
from radixserve_tools.simulator import cli
from radixserve_tools.simulator.calibrate import (
    MEMORY_COMPUTE_NORMS,
    fit,
    predicted_seconds,
    recorded_forwards,
)
from radixserve_tools.simulator.calibration_passes import (
    CALIBRATION_RUNS,
    WAKE_IDLE_S,
    CalibrationShape,
    CalibrationTimer,
    Run,
    calibration_batch,
)
from radixserve_tools.simulator.cli import _describe, calibrate_engine
from radixserve_tools.simulator.cost_model import ForwardShape, ModelShape, SharedPrefix, forward_seconds
from radixserve_tools.simulator.executor import ForwardRecord
from radixserve_tools.simulator.hardware import HardwareProfile, PointwiseCosts, load_profile
from radixserve_tools.simulator.model_configs import BUILTIN_MODEL_CONFIGS
from radixserve_tools.simulator.peaks import (
    LINEAR_WIDTHS,
    OVERLAP_ROWS,
    fit_overlap,
    overlap_stack_bytes,
    weights_bandwidth,
)
from tests.simulator.test_cost_model import LLAMA_8B

_RECORDS: dict[str, list[list[ForwardRecord]]] = {}


def _calibration_records(config: ModelConfig) -> list[list[ForwardRecord]]:
    """Every calibration run's forwards for a model, recorded once per module: the scheduler's
    batching does not depend on the profile a test fits, and each recording builds its pools."""
    key = repr(config)
    if key not in _RECORDS:
        shapes = enumerate(CALIBRATION_RUNS)
        _RECORDS[key] = [recorded_forwards(config, shape, i, 200_000) for i, shape in shapes]
    return _RECORDS[key]


def _fit_to(
    truth: HardwareProfile, model: dict[str, Any] = LLAMA_8B, row_overhead_s: float | None = None
) -> tuple[HardwareProfile, list[float], list[float]]:
    """The profile fitted to the calibration runs' times as `truth` predicts them for `model`
    (its row cost held at `row_overhead_s` if given); those times, and the fitted profile's
    predictions of them."""
    config = ModelConfig.from_hf_dict(model)
    recorded = _calibration_records(config)
    pairs = list(zip(CALIBRATION_RUNS, recorded, strict=True))
    times = [predicted_seconds(config, truth, shape, forwards) for shape, forwards in pairs]
    runs = [Run(shape, time) for shape, time in zip(CALIBRATION_RUNS, times, strict=True)]
    fitted = fit(config, runs, recorded, _measured(truth), truth.cascade_attention, row_overhead_s)
    predicted = [predicted_seconds(config, fitted, shape, forwards) for shape, forwards in pairs]
    return fitted, times, predicted


def _measured(truth: HardwareProfile, **fields: Any) -> HardwareProfile:
    """What calibrate measures of a device whose every figure `truth` holds, `fields` of it
    replaced (a measurement left out)."""
    return dataclasses.replace(truth.measured(), **fields)


def test_the_fit_recovers_a_cpu_like_profile() -> None:
    """An 8B model on a slow device: a 32-request decode step is compute-bound, which shows its
    linears' own efficiency; attention over a cached context runs slower than a prompt's, and a
    cascade's over a prefix the batch shares faster."""
    # Its bandwidth as calibrate measures it (the rate the engine's linear streams weights), so
    # with an efficiency of 1: the fit takes the measured bandwidth as it is.
    truth = HardwareProfile(
        "truth",
        2e12,
        6.2e10,
        6e10,
        0.36,
        1.0,
        2e-3,
        attention_efficiency=0.05,
        decode_flops_efficiency=0.5,
        context_attention_efficiency=0.02,
        cascade_attention=True,
        shared_prefix_attention_efficiency=0.1,
        shared_prefix_key_s=1e-6,
    )
    fitted, times, predicted = _fit_to(truth)
    assert predicted == pytest.approx(times, rel=0.02)  # the pattern search refines the grid
    assert fitted.memory_compute_norm is None  # a roofline, as the truth's
    assert fitted.flops_efficiency == pytest.approx(0.36, rel=0.1), fitted
    assert fitted.bandwidth_efficiency == 1.0 and fitted.memory_bandwidth == truth.memory_bandwidth
    assert fitted.decode_flops_efficiency == pytest.approx(0.5, rel=0.1), fitted
    # A prompt's causal attention is a small share of the 8B model's prefill times: known less well.
    assert fitted.attention_efficiency == pytest.approx(0.05, rel=0.15), fitted
    assert fitted.context_attention_efficiency == pytest.approx(0.02, rel=0.1), fitted
    assert fitted.shared_prefix_attention_efficiency == pytest.approx(0.1, rel=0.1), fitted
    # Its cost per key trades against that efficiency in an 8B model's times, and its decode steps
    # read the weights for longer than they compute (so their attention's efficiency cannot be
    # known): what is known is the cost of the cascade's steps and of long-context ones.
    shape = ModelShape.of(ModelConfig.from_hf_dict(LLAMA_8B))
    steps = [ForwardShape([1] * 4, [1024] * 4, 4, True, (SharedPrefix(1024, 4, 4),))]
    steps.append(ForwardShape([1] * 2, [1024] * 2, 2, True))
    for step in steps:
        assert forward_seconds(shape, fitted, step) == pytest.approx(
            forward_seconds(shape, truth, step), rel=0.02
        )


# A profile like the one fitted on a 2-core Zen 4 for the default model: its decode steps compute
# for longer than they read, so every attention efficiency shows in the calibration runs' times.
ZEN4_LIKE = HardwareProfile(
    "truth",
    4.2e11,
    2.3e11,
    2.5e10,
    0.65,
    1.0,
    10e-3,
    attention_efficiency=0.34,
    decode_overhead_s=8.3e-3,
    cascade_attention=True,
    row_overhead_s=85e-6,
    decode_flops_efficiency=0.93,
    context_attention_efficiency=0.15,
    decode_attention_efficiency=0.10,
    shared_prefix_attention_efficiency=0.28,
    shared_prefix_key_s=250e-9,
    attention_block=512,
    idle_wake_s=12e-3,
)


def test_the_fit_recovers_this_cpus_attention() -> None:
    """The default model on a profile like the one fitted on a 2-core Zen 4: decode steps compute
    for longer than they read, so every attention efficiency shows (a prompt's, an extend's over a
    cached prefix, a decode step's, a cascade's over a shared prefix and its cost per key), and so
    does the size of the blocks a prompt's causal attention skips keys by."""
    truth = ZEN4_LIKE
    fitted, times, predicted = _fit_to(truth, BUILTIN_MODEL_CONFIGS["smollm2-135m"])
    assert predicted == pytest.approx(times, rel=0.02)
    assert fitted.attention_block == 512  # the causal mask's blocks, as torch's CPU kernel's
    # The extend timed after an idle spell, less the same extend as the rest of the fit predicts it.
    assert fitted.idle_wake_s == pytest.approx(12e-3, abs=1e-3)
    assert fitted.idle_wake_after_s == WAKE_IDLE_S
    for field in (
        "attention_efficiency",
        "context_attention_efficiency",
        "decode_attention_efficiency",
        "shared_prefix_attention_efficiency",
        "shared_prefix_key_s",
    ):
        assert getattr(fitted, field) == pytest.approx(getattr(truth, field), rel=0.1), field


def test_a_measured_prompt_attention_is_held_and_the_rest_fitted_around_it() -> None:
    """Where calibrate measured a prompt's attention by its length, it prices the new tokens among
    themselves: the fit has no block to pick nor an efficiency of theirs to fit (it leaves
    attention_efficiency unset), and recovers the other attention efficiencies around it."""
    table = ((1, 7e-8), (16, 1.3e-7), (64, 4e-7), (256, 2.6e-6), (1024, 2.8e-5), (2048, 9e-5))
    measured = {"attention_efficiency": None, "attention_block": 1, "prompt_attention": table}
    truth = dataclasses.replace(ZEN4_LIKE, **measured)
    fitted, times, predicted = _fit_to(truth, BUILTIN_MODEL_CONFIGS["smollm2-135m"])
    assert predicted == pytest.approx(times, rel=0.02)
    assert fitted.prompt_attention == table
    assert fitted.attention_efficiency is None and fitted.attention_block == 1
    for field in (
        "flops_efficiency",
        "context_attention_efficiency",
        "decode_attention_efficiency",
        "shared_prefix_attention_efficiency",
        "shared_prefix_key_s",
    ):
        assert getattr(fitted, field) == pytest.approx(getattr(truth, field), rel=0.1), field


def test_a_measured_extend_attention_is_held_and_the_rest_fitted_around_it() -> None:
    """Where calibrate also measured an extend's attention over a cached prefix by its pairs, that
    prices every extend no cascade attends: the fit has no efficiency over a cached context to fit
    (it leaves context_attention_efficiency unset), and recovers the others around it."""
    prompt = ((1, 7e-8), (16, 1.3e-7), (64, 4e-7), (256, 2.6e-6), (1024, 2.8e-5), (2048, 9e-5))
    extend = ((1_040, 1.2e-7), (8_448, 4e-7), (36_864, 1.4e-6), (1_310_720, 4.5e-5))
    measured = {
        "attention_efficiency": None,
        "attention_block": 1,
        "prompt_attention": prompt,
        "context_attention_efficiency": None,
        "extend_attention": extend,
    }
    truth = dataclasses.replace(ZEN4_LIKE, **measured)
    fitted, times, predicted = _fit_to(truth, BUILTIN_MODEL_CONFIGS["smollm2-135m"])
    assert predicted == pytest.approx(times, rel=0.02)
    assert fitted.extend_attention == extend
    assert fitted.context_attention_efficiency is None
    for field in (
        "flops_efficiency",
        "decode_attention_efficiency",
        "shared_prefix_attention_efficiency",
        "shared_prefix_key_s",
    ):
        assert getattr(fitted, field) == pytest.approx(getattr(truth, field), rel=0.1), field


def test_the_fit_tells_a_device_whose_memory_reads_overlap_its_compute_in_part() -> None:
    """On a 2-core CPU the cores that stream a decode step's weights also compute its rows, so the
    step grows with its rows from the first, slowly at first: memory and compute overlap in part.
    The fit finds how (of MEMORY_COMPUTE_NORMS) and the figures with it; a roofline would have
    to fake the growth with a cost per row."""
    truth = HardwareProfile(
        "truth",
        1.6e11,
        2.6e10,
        2.5e10,
        1.0,
        1.0,
        13e-3,
        attention_efficiency=0.7,
        decode_overhead_s=1e-3,
        cascade_attention=True,
        row_overhead_s=300e-6,
        decode_flops_efficiency=1.1,
        context_attention_efficiency=0.38,
        decode_attention_efficiency=0.35,
        shared_prefix_attention_efficiency=0.7,
        shared_prefix_key_s=280e-9,
        attention_block=512,
        memory_compute_norm=1.5,
        pointwise=PointwiseCosts(norm_s=1.3e-9, rotary_s=2.3e-9, activation_s=3.7e-9),
    )
    fitted, times, predicted = _fit_to(truth, BUILTIN_MODEL_CONFIGS["smollm2-135m"])
    assert predicted == pytest.approx(times, rel=0.01)
    assert fitted.memory_compute_norm == 1.5
    assert fitted.decode_flops_efficiency == pytest.approx(1.1, rel=0.1), fitted
    assert fitted.row_overhead_s == pytest.approx(300e-6, rel=0.2), fitted
    assert fitted.decode_attention_efficiency == pytest.approx(0.35, rel=0.1), fitted


def test_a_profile_fitted_on_one_model_predicts_a_wider_ones_linears() -> None:
    """Fitted on the 576-wide SmolLM2 with the linears' rates by width, a profile predicts an 8B
    (4096 wide, whose linears run twice as fast here) as the device would run it. Fitted on one
    peak for every width, it predicts the 8B's prefills about twice as slow."""
    rates = ((512, 1e11), (4096, 2e11))
    truth = HardwareProfile(
        "truth", 1.5e11, 3e10, 2.5e10, 0.8, 1.0, 10e-3, attention_efficiency=0.5, linear_rates=rates
    )
    small = ModelConfig.from_hf_dict(BUILTIN_MODEL_CONFIGS["smollm2-135m"])
    recorded = _calibration_records(small)
    pairs = list(zip(CALIBRATION_RUNS, recorded, strict=True))
    runs = [Run(shape, predicted_seconds(small, truth, shape, forwards)) for shape, forwards in pairs]
    with_rates = fit(small, runs, recorded, _measured(truth))
    one_peak = fit(small, runs, recorded, _measured(truth, linear_rates=()))
    wide = ModelShape.of(ModelConfig.from_hf_dict(LLAMA_8B))
    prefill = ForwardShape([512], [0], 1)
    measured = forward_seconds(wide, truth, prefill)
    assert forward_seconds(wide, with_rates, prefill) == pytest.approx(measured, rel=0.03)
    assert forward_seconds(wide, one_peak, prefill) > 1.5 * measured


def test_measured_pointwise_costs_carry_a_fit_to_a_wider_model() -> None:
    """Norms, rotary embedding and activation cost a 576-wide model a larger share of its prefill
    than a 4096-wide one. Measured apart, a profile fitted on the narrow model predicts the wide
    one's prefill as the device runs it; unknown to the fit, they are folded into the linears'
    efficiency, and the wide model's prefill comes out slow."""
    pointwise = PointwiseCosts(norm_s=1.3e-9, rotary_s=2.3e-9, activation_s=3.7e-9)
    truth = HardwareProfile(
        "truth", 1.5e11, 3e10, 2.5e10, 0.95, 1.0, 10e-3, attention_efficiency=0.5, pointwise=pointwise
    )
    small = ModelConfig.from_hf_dict(BUILTIN_MODEL_CONFIGS["smollm2-135m"])
    recorded = _calibration_records(small)
    pairs = list(zip(CALIBRATION_RUNS, recorded, strict=True))
    runs = [Run(shape, predicted_seconds(small, truth, shape, forwards)) for shape, forwards in pairs]
    known = fit(small, runs, recorded, _measured(truth))
    unknown = fit(small, runs, recorded, _measured(truth, pointwise=PointwiseCosts()))
    assert known.flops_efficiency == pytest.approx(0.95, rel=0.03)
    assert unknown.flops_efficiency < 0.85  # the pointwise ops' time taken for slower linears
    wide = ModelShape.of(ModelConfig.from_hf_dict(LLAMA_8B))
    prefill = ForwardShape([512], [0], 1)
    measured = forward_seconds(wide, truth, prefill)
    assert forward_seconds(wide, known, prefill) == pytest.approx(measured, rel=0.02)
    assert forward_seconds(wide, unknown, prefill) > 1.08 * measured


# An 8B model's device fast enough that a decode step's fixed costs (per step and per row) show.
HOST_BOUND = HardwareProfile(
    "truth",
    2e14,
    1.6e12,
    6e10,
    0.4,
    1.0,
    2e-3,
    attention_efficiency=0.2,
    decode_overhead_s=20e-3,
    row_overhead_s=200e-6,
)


def test_the_fit_recovers_a_host_bound_profile() -> None:
    """The same model on a device fast enough that a decode step's fixed costs (per step and per
    row) show: told apart from a prefill forward's."""
    truth = HOST_BOUND
    fitted, times, predicted = _fit_to(truth)
    assert predicted == pytest.approx(times, rel=0.02)
    # A decode step reads the same weights at every batch size, so the runs show only the sum of
    # its fixed cost and the weights' reading: the measured bandwidth splits it.
    assert fitted.decode_overhead_s == pytest.approx(20e-3, rel=0.05), fitted
    shape = ModelShape.of(ModelConfig.from_hf_dict(LLAMA_8B))
    for rows in (1, 8, 32):
        step = ForwardShape([1] * rows, [100] * rows, rows, decode=True)
        assert forward_seconds(shape, fitted, step) == pytest.approx(
            forward_seconds(shape, truth, step), rel=0.02
        )
    assert fitted.row_overhead_s == pytest.approx(200e-6, rel=0.2), fitted
    assert fitted.forward_overhead_s < 5e-3, fitted


def _overlap(
    norm: float | None, memory: float = 9e-3, per_row: float = 1.5e-3
) -> tuple[tuple[int, float], ...]:
    """A stack of linears' times by rows (HardwareProfile.decode_overlap) on a device whose
    compute and memory combine by `norm`."""
    device = HardwareProfile("device", 1.0, 1.0, 0.0, memory_compute_norm=norm)
    return tuple((rows, device.roofline(rows * per_row, memory, decode=True)) for rows in OVERLAP_ROWS)


@pytest.mark.parametrize("norm", [None, 1.0, 1.5, 1.7, 2.0, 3.0])
def test_a_stack_of_linears_shows_the_norm_and_the_weights_reading(norm: float | None) -> None:
    """peaks.fit_overlap splits the stack's times into the norm, the weights' reading and the
    compute per row; the reading gives the profile's bandwidth."""
    fitted = fit_overlap(_overlap(norm))
    assert fitted.norm == norm
    assert fitted.memory_s == pytest.approx(9e-3) and fitted.per_row_s == pytest.approx(1.5e-3)
    bandwidth = weights_bandwidth(_overlap(norm), torch.bfloat16)
    assert bandwidth == pytest.approx(overlap_stack_bytes(torch.bfloat16) / 9e-3)
    assert overlap_stack_bytes(torch.bfloat16) == 256 * 2**20


def test_a_measured_overlap_sets_the_fits_norm() -> None:
    """Measured, the norm is not fitted: one model's runs tell the norms apart poorly (a 576-wide
    model's fits picked the sum, which priced a 2048-wide model's decode steps up to 27% slow)."""
    truth = dataclasses.replace(HOST_BOUND, memory_compute_norm=1.7, decode_overlap=_overlap(1.7))
    fitted, times, predicted = _fit_to(truth)
    assert 1.7 not in MEMORY_COMPUTE_NORMS and fitted.memory_compute_norm == 1.7
    assert predicted == pytest.approx(times, rel=0.02)
    assert fitted.decode_overlap == truth.decode_overlap


def test_a_row_cost_the_engine_measured_is_held_and_the_rest_fitted_around_it() -> None:
    """calibrate holds the cost per row at what the engine's scheduler measured of itself. Held at
    the truth's, the fit keeps it to the nanosecond and recovers the rest; held at a wrong value,
    it stays there, and a decode step's linears (and how they combine with memory) take up the
    difference, running slower than the truth's: one model's runs cannot tell the two apart, which
    is why the engine measures the row cost instead. (Held at the truth's, this host-bound decode
    step hides its linears' efficiency, which any value fits.)"""
    truth = HOST_BOUND
    held, times, predicted = _fit_to(truth, row_overhead_s=200e-6)
    assert held.row_overhead_s == 200e-6
    assert predicted == pytest.approx(times, rel=0.02)
    assert held.decode_overhead_s == pytest.approx(20e-3, rel=0.05), held
    wrong, times, predicted = _fit_to(truth, row_overhead_s=0.0)
    assert wrong.row_overhead_s == 0.0
    assert predicted == pytest.approx(times, rel=0.02)
    assert wrong.decode_flops_efficiency is not None
    assert wrong.decode_flops_efficiency < truth.flops_efficiency  # the truth's decode linears


def test_calibrate_a_real_engine(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """calibrate times its passes and measures the peaks after each, and fits their medians: the
    first pass and measurement are real, the next two stand in for a slow and a fast spell of the
    host (every time twice and half as long), so the medians are the real ones."""
    order: list[str] = []
    real_pass, real_peaks = CalibrationTimer.time_pass, cli.measure_engine_peaks
    measured: list[HardwareProfile] = []
    real_times: list[float] = []

    def time_pass(timer: CalibrationTimer) -> list[float]:
        order.append("pass")
        if not timer.passes:
            real_times.extend(real_pass(timer))
            return real_times
        scale = 2.0 if len(order) == 3 else 0.5
        timer.pass_samples.append([[t * scale for t in samples] for samples in timer.pass_samples[0]])
        timer.passes.append([t * scale for t in timer.passes[0]])
        return timer.passes[-1]

    def measure_peaks(engine: Any, name: str) -> HardwareProfile:
        order.append("peaks")
        if not measured:
            measured.append(real_peaks(engine, name))
            return measured[0]
        return _scaled_times(measured[0], 2.0 if len(order) == 4 else 0.5)

    monkeypatch.setattr(CalibrationTimer, "time_pass", time_pass)
    monkeypatch.setattr(cli, "measure_engine_peaks", measure_peaks)
    engine = Engine(str(tiny_model_dir("llama")), dtype="float32", max_total_tokens=4096, log_level="warning")
    try:
        profile, rows, steadiness = calibrate_engine(engine, name="this-cpu", passes=3)
        host = engine.get_stats()["decode_host_time"]
        engine.check_kv_invariant()
    finally:
        engine.shutdown()
    assert order == ["pass", "peaks"] * 3
    assert [run.seconds for run, _ in rows] == real_times  # each run's median over the passes
    # The slow and the fast spell moved the passes and the peaks four times over: calibrate says so.
    assert steadiness.pass_ratios == pytest.approx((1.0, 2.0, 0.5))
    assert steadiness.spread == pytest.approx(3.0) and not steadiness.steady
    assert "warning: this machine's speed moved by up to 300%" in steadiness.describe()
    (real,) = measured
    assert (profile.peak_flops, profile.memory_bandwidth) == (real.peak_flops, real.memory_bandwidth)
    assert profile.linear_rates == real.linear_rates and profile.decode_overlap == real.decode_overlap
    assert len(rows) == len(CALIBRATION_RUNS)
    assert profile.peak_flops > 0 and profile.memory_bandwidth > 0 and profile.memory_bytes > 0
    # The usual widths and the calibration model's own (whose rate the efficiencies are shares of).
    width = load_model_config(resolve_model_source(str(tiny_model_dir("llama")))).hidden_size
    assert [w for w, _ in profile.linear_rates] == sorted({*LINEAR_WIDTHS, width})
    assert all(run.seconds > 0 and predicted > 0 for run, predicted in rows)
    # The cost per row held at the scheduler's own, as its line over every decode step measured it.
    assert host["steps"] > 0 and host["per_row_s"] is not None
    assert profile.row_overhead_s == pytest.approx(max(0.0, host["per_row_s"]), abs=1e-9)
    # What `calibrate` prints of it: every fitted figure, the cascade's where the engine has one.
    line = _describe(profile)
    assert "an extend's over a cached prefix as measured at 1,040-" in line and "a decode step's x" in line
    assert profile.extend_attention and profile.context_attention_efficiency is None
    assert line.startswith(f"linears by hidden size {min(width, 512)}: ")
    assert f"more for a forward after {WAKE_IDLE_S:g} s idle" in line
    assert profile.idle_wake_s >= 0 and profile.idle_wake_after_s == WAKE_IDLE_S
    assert ("per key and layer" in line) == profile.cascade_attention
    path = tmp_path / "cpu.json"
    profile.save(path)
    assert load_profile(str(path)) == profile


def _scaled_times(peaks: HardwareProfile, scale: float) -> HardwareProfile:
    """A measurement of the peaks on a host `scale` times as slow: every rate over it, every time
    times it."""

    def times(table: tuple[tuple[int, float], ...]) -> tuple[tuple[int, float], ...]:
        return tuple((size, seconds * scale) for size, seconds in table)

    return dataclasses.replace(
        peaks,
        peak_flops=peaks.peak_flops / scale,
        memory_bandwidth=peaks.memory_bandwidth / scale,
        linear_rates=tuple((width, rate / scale) for width, rate in peaks.linear_rates),
        decode_overlap=times(peaks.decode_overlap),
        prompt_attention=times(peaks.prompt_attention),
        extend_attention=times(peaks.extend_attention),
    )


def test_a_cached_prefix_run_times_only_its_batch() -> None:
    """A calibration shape with a cached prefix: its recorded forwards are the timed batch's alone
    (the request that cached the prefix is left out, as its time is), extending over that prefix."""
    config = ModelConfig.from_hf_dict(LLAMA_8B)
    shape = CalibrationShape(4, 64, 3, cached_prefix=512)
    records = recorded_forwards(config, shape, 0, 200_000)
    assert [r.mode for r in records] == ["EXTEND", "DECODE", "DECODE"]
    assert records[0].shape.q_lens == [64] * 4 and records[0].shape.prefix_lens == [512] * 4
    assert records[-1].shape.prefix_lens == [577] * 4
    # Timed right after the prefix's request, as calibrate times it; the wake run after its idle.
    assert records[0].idle_s < 0.01
    (woken, *_) = recorded_forwards(config, dataclasses.replace(shape, idle_s=WAKE_IDLE_S), 0, 200_000)
    assert woken.idle_s == pytest.approx(WAKE_IDLE_S, abs=0.01) and woken.shape == records[0].shape
    # Without a prefix the same batch prefills whole prompts.
    (cold, *_) = recorded_forwards(config, CalibrationShape(4, 64, 3), 0, 200_000)
    assert cold.shape.q_lens == [64] * 4 and cold.shape.prefix_lens == [0] * 4


def test_prefix_groups_give_decode_steps_no_prefix_of_the_whole_batch() -> None:
    """Requests over several cached prefixes: the extend attends each group's prefix once (a
    cascade per group), and the decode steps have no prefix every request shares, so their
    attention over the context is a decode step's own, with no cascade."""
    config = ModelConfig.from_hf_dict(LLAMA_8B)
    shape = CalibrationShape(8, 16, 3, cached_prefix=512, prefix_groups=4)
    assert shape.label == "8 x 16 over 4 x 512 cached + 3"
    batch = calibration_batch(shape, 1000, seed=0)
    assert len(batch.prefixes) == 4 and len({tuple(p) for p in batch.prefixes}) == 4
    assert [batch.prefixes.index(prompt[:512]) for prompt in batch.prompts] == [0, 1, 2, 3] * 2
    extend, *decodes = recorded_forwards(config, shape, 0, 200_000)
    assert extend.mode == "EXTEND" and extend.shape.prefix_lens == [512] * 8
    assert [(p.length, p.requests, p.queries) for p in extend.shape.shared_prefixes] == [(512, 2, 32)] * 4
    assert [r.mode for r in decodes] == ["DECODE"] * 2
    assert [r.shape.prefix_lens for r in decodes] == [[528] * 8, [529] * 8]
    assert all(r.shape.shared_prefixes == () for r in decodes)
    # One group is the whole batch's prefix: its decode steps are a cascade's.
    (_, shared, _) = recorded_forwards(config, CalibrationShape(8, 16, 3, cached_prefix=512), 0, 200_000)
    assert [(p.length, p.requests) for p in shared.shape.shared_prefixes] == [(512, 8)]
