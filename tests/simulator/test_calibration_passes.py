"""The calibration runs' timed passes (simulator/calibration_passes.py): each shape's median over
the passes and the spread of its samples within each, how many samples a pass takes of a short
run, a round's neighbouring passes, the order of a round's repeats, and a saved run's shape read
back."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from radixserve_tools.simulator.calibrate import forward_noise
from radixserve_tools.simulator.calibration_passes import (
    CALIBRATION_RUNS,
    WAKE_IDLE_S,
    CalibrationShape,
    CalibrationTimer,
    neighbour_passes,
    spread_order,
    timed_runs,
)


class _ScriptedEngine:
    """An engine whose every timed batch reports the next of a list of latencies: what the timer
    makes of them is then known."""

    context_len, vocab_size = 4096, 1000

    def __init__(self, latencies: list[float]) -> None:
        self.latencies = latencies
        self.calls: list[int] = []

    def flush_cache(self) -> None:
        pass

    def generate(self, input_ids: list[Any], sampling_params: dict[str, Any]) -> list[dict[str, Any]]:
        if isinstance(input_ids[0], int):  # a cached prefix's request: untimed
            return [{"meta_info": {"e2e_latency": 0.0}}]
        self.calls.append(len(input_ids))
        latency = self.latencies.pop(0)
        return [{"meta_info": {"e2e_latency": latency / (1 + i)}} for i in range(len(input_ids))]


def test_the_timer_takes_each_runs_median_over_the_timed_passes() -> None:
    shapes = len(CALIBRATION_RUNS)
    # An untimed first pass (all 100 s), then passes of 1, 3 and 2 s per run.
    engine = _ScriptedEngine([100.0] * shapes + [1.0] * shapes + [3.0] * shapes + [2.0] * shapes)
    slept: list[float] = []
    timer = CalibrationTimer.start(engine, sleep=slept.append)
    for _ in range(3):
        timer.time_pass()
    runs = timer.runs()
    assert [run.shape for run in runs] == list(CALIBRATION_RUNS)
    # The run after an idle spell idles before its batch, in every pass.
    assert slept == [WAKE_IDLE_S] * 4
    # The batch's span is its slowest request's latency; the warm-up pass is left out.
    assert [run.seconds for run in runs] == [2.0] * shapes
    assert engine.calls == [shape.requests for shape in CALIBRATION_RUNS] * 4
    with pytest.raises(ValueError, match="no calibration pass"):
        CalibrationTimer.start(_ScriptedEngine([1.0] * shapes), sleep=lambda seconds: None).runs()


def test_a_rounds_profile_is_fitted_on_the_passes_next_to_it() -> None:
    """A validation times a pass before each round and one after the last: round k's neighbours
    are passes k and k + 1, and the runs of those passes alone are theirs."""
    assert neighbour_passes(0, 4) == [0, 1] and neighbour_passes(2, 4) == [2, 3]
    assert neighbour_passes(2, 3) == [2]  # no pass after the last round
    shapes = len(CALIBRATION_RUNS)
    engine = _ScriptedEngine([100.0] * shapes + [1.0] * shapes + [3.0] * shapes + [8.0] * shapes)
    timer = CalibrationTimer.start(engine, sleep=lambda seconds: None)
    for _ in range(3):
        timer.time_pass()
    assert [run.seconds for run in timer.runs()] == [3.0] * shapes
    assert [run.seconds for run in timer.runs(neighbour_passes(1, 3))] == [5.5] * shapes
    assert [run.seconds for run in timer.runs([2])] == [8.0] * shapes
    # The same from the samples a validation saves (benchmarks/simulator_refit.py --passes).
    assert timed_runs(timer.shapes, timer.pass_samples, [0, 1]) == timer.runs([0, 1])
    with pytest.raises(ValueError, match="no calibration pass"):
        timer.runs([])


def test_a_saved_runs_shape_is_read_back() -> None:
    shape = CalibrationShape(8, 16, 48, cached_prefix=512, prefix_groups=4)
    row = {**dataclasses.asdict(shape), "measured_s": 2.1, "log_squares": 0.0}
    assert CalibrationShape.from_row(row) == shape
    assert CalibrationShape.from_row({"requests": 1, "prompt_len": 64, "output_len": 1}).label == "1 x 64 + 1"


def test_the_timer_samples_a_short_run_several_times_per_pass() -> None:
    shapes = len(CALIBRATION_RUNS)
    # Untimed, every run takes a quarter of SAMPLE_S (1 s) or 0.1 s: 4 samples per pass, or 5 at
    # most; a pass's time for a run is the median of its samples.
    first = [0.25] * (shapes - 1) + [0.1]
    passes = [1.0, 9.0, 2.0, 3.0] * (shapes - 1) + [1.0, 9.0, 2.0, 3.0, 0.5]
    engine = _ScriptedEngine(first + passes)
    timer = CalibrationTimer.start(engine, sleep=lambda seconds: None)
    assert timer.samples == [4] * (shapes - 1) + [5]
    assert timer.time_pass() == [2.5] * (shapes - 1) + [2.0]
    assert not engine.latencies
    # The samples' spread within the pass: the forward noise is that of the single-forward runs
    # (one request, one output token, no idle before it), all of which took 1, 9, 2 and 3 s.
    runs = timer.runs()
    spread = float(np.std(np.log([1.0, 9.0, 2.0, 3.0]), ddof=1))
    assert all(run.log_df == 3 for run in runs[:-1]) and runs[-1].log_df == 4
    assert runs[0].log_squares == pytest.approx(3 * spread**2)
    assert forward_noise(runs) == pytest.approx(spread)
    shapes_of_one = [r.shape for r in runs if r.shape.requests == r.shape.output_len == 1]
    assert len([shape for shape in shapes_of_one if not shape.idle_s]) == 5
    assert forward_noise([dataclasses.replace(r, log_squares=0.0, log_df=0) for r in runs]) == 0.0


def test_a_rounds_repeats_spread_over_it() -> None:
    """Each run's repeats take even steps across the round: one repeat goes in the middle, three
    at a sixth, a half and five sixths; where repeats fall together the first run goes first."""
    order = spread_order([1, 3, 2])
    assert order == [(1, 0), (2, 0), (0, 0), (1, 1), (2, 1), (1, 2)]
    assert sorted(order) == [(0, 0), (1, 0), (1, 1), (1, 2), (2, 0), (2, 1)]  # each once
    # With five of one run and one of another, the single one lands in the middle of the five.
    assert spread_order([5, 1]) == [(0, 0), (0, 1), (0, 2), (1, 0), (0, 3), (0, 4)]
    assert spread_order([0, 2]) == [(1, 0), (1, 1)]
    assert spread_order([]) == []
