"""How steady the machine was while calibrate timed it (simulator/steadiness.py): each pass's
total against the median pass's, the peaks' readings after the passes, and the warning past the
validation's target; and calibrate's --passes flag."""

from __future__ import annotations

import dataclasses

import pytest

from radixserve.cli import main
from radixserve_tools.simulator.hardware import HardwareProfile
from radixserve_tools.simulator.steadiness import STEADY_WITHIN, HostSteadiness

PEAKS = HardwareProfile("cpu", 100e9, 30e9, 8e9, linear_rates=((512, 90e9), (576, 80e9), (1024, 95e9)))


def _peaks(scale: float) -> HardwareProfile:
    """The same machine `scale` times as fast."""
    rates = tuple((width, rate * scale) for width, rate in PEAKS.linear_rates)
    flops, bandwidth = PEAKS.peak_flops * scale, PEAKS.memory_bandwidth * scale
    return dataclasses.replace(PEAKS, peak_flops=flops, memory_bandwidth=bandwidth, linear_rates=rates)


def test_a_steady_machine_is_described_without_a_warning() -> None:
    passes = [[1.0, 2.0], [1.02, 2.0], [0.98, 1.99]]
    steadiness = HostSteadiness.of(passes, [_peaks(1.0), _peaks(1.03), _peaks(0.99)], width=576)
    assert steadiness.pass_totals == pytest.approx((3.0, 3.02, 2.97))
    assert steadiness.pass_ratios == pytest.approx((1.0, 3.02 / 3.0, 2.97 / 3.0))
    # The model's own width's rate, not the others'.
    assert steadiness.linear_rates == pytest.approx((80e9, 82.4e9, 79.2e9))
    assert steadiness.weights_rates == pytest.approx((30e9, 30.9e9, 29.7e9))
    assert steadiness.spread == pytest.approx(1.03 / 0.99 - 1)
    assert steadiness.steady
    line = steadiness.describe()
    assert line == (
        "the passes took 0.99-1.01 of the median pass's time; after them the 576-wide linears read "
        "79-82 GFLOP/s and the weights 29.7-30.9 GB/s"
    )


def test_a_machine_that_moved_past_the_target_is_warned_of() -> None:
    """One fast spell in the peaks alone is enough: a prediction meets the machine as it then is."""
    passes = [[3.0], [3.0], [3.0], [3.0]]
    peaks = [_peaks(1.0), _peaks(1.0), _peaks(1.6), _peaks(1.0)]
    steadiness = HostSteadiness.of(passes, peaks, width=576)
    assert steadiness.pass_ratios == (1.0,) * 4
    assert steadiness.spread == pytest.approx(0.6) and not steadiness.steady
    first, warning = steadiness.describe().splitlines()
    assert "80-128 GFLOP/s" in first and "30.0-48.0 GB/s" in first
    assert warning.startswith("warning: this machine's speed moved by up to 60% while calibrate timed it")
    assert "--passes" in warning
    # Just past the target on the passes' totals alone.
    slow = 1 + STEADY_WITHIN + 0.01
    assert not HostSteadiness.of([[1.0], [slow]], [PEAKS, PEAKS], width=576).steady
    assert HostSteadiness.of([[1.0], [1 + STEADY_WITHIN - 0.01]], [PEAKS, PEAKS], width=576).steady


def test_a_profile_without_rates_by_width_gives_its_peak() -> None:
    gpu = HardwareProfile("gpu", 900e12, 3e12, 80e9)
    steadiness = HostSteadiness.of([[0.1]], [gpu], width=2048)
    assert steadiness.linear_rates == (900e12,) and steadiness.steady
    with pytest.raises(ValueError, match="2 passes and 1 readings of the peaks"):
        HostSteadiness.of([[0.1], [0.1]], [gpu], width=2048)
    with pytest.raises(ValueError):
        HostSteadiness.of([], [], width=2048)


def test_calibrate_refuses_fewer_than_one_pass(capsys: pytest.CaptureFixture[str]) -> None:
    for wrong in ("0", "-2", "two"):
        with pytest.raises(SystemExit) as exit_info:
            main(["calibrate", "--passes", wrong])
        assert exit_info.value.code == 2
        assert "--passes" in capsys.readouterr().err
