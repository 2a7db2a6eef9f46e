"""How steady the machine was while `radixserve calibrate` timed it: each timed pass's total, and
the calibration model's linears and the weights' rate as the peaks after each pass read them.

A profile holds each figure's median over the passes. On a shared host whose speed moves by more
than a prediction aims at (a 2-core Zen 3 read the same matmul at 77-168 GFLOP/s within
minutes: docs/simulator.md, "The host's speed"), a prediction is as far off as the
host then is from that median, so calibrate says how far its own measurements moved."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from radixserve_tools.simulator.hardware import HardwareProfile

# Beyond this spread (the largest against the least, less one) the host moved by more than the
# validation's 9% target while it was timed.
STEADY_WITHIN = 0.09


def _spread(values: Sequence[float]) -> float:
    return max(values) / min(values) - 1.0


@dataclass(frozen=True)
class HostSteadiness:
    """Per timed pass: its total seconds (the sum of its runs' medians), and after it the rate of
    the calibration model's linears (FLOP/s at its width) and the weights' (bytes/s)."""

    pass_totals: tuple[float, ...]
    linear_rates: tuple[float, ...]
    weights_rates: tuple[float, ...]
    width: int

    @classmethod
    def of(
        cls, passes: Sequence[Sequence[float]], peaks: Sequence[HardwareProfile], width: int
    ) -> HostSteadiness:
        """From a CalibrationTimer's passes (each run's seconds per pass) and the peaks measured
        after each. A profile without rates by width (a GPU's) gives its peak FLOP/s."""
        if not passes or len(passes) != len(peaks):
            raise ValueError(f"{len(passes)} passes and {len(peaks)} readings of the peaks: one after each")
        return cls(
            tuple(sum(times) for times in passes),
            tuple(dict(p.linear_rates).get(width, p.peak_flops) for p in peaks),
            tuple(p.memory_bandwidth for p in peaks),
            width,
        )

    @property
    def pass_ratios(self) -> tuple[float, ...]:
        """Each pass's total against the median pass's."""
        median = statistics.median(self.pass_totals)
        return tuple(total / median for total in self.pass_totals)

    @property
    def spread(self) -> float:
        """The most any of the three moved: its largest reading against its least, less one."""
        return max(_spread(self.pass_totals), _spread(self.linear_rates), _spread(self.weights_rates))

    @property
    def steady(self) -> bool:
        return self.spread <= STEADY_WITHIN

    def describe(self) -> str:
        ratios = self.pass_ratios
        linears = f"{min(self.linear_rates) / 1e9:,.0f}-{max(self.linear_rates) / 1e9:,.0f} GFLOP/s"
        weights = f"{min(self.weights_rates) / 1e9:.1f}-{max(self.weights_rates) / 1e9:.1f} GB/s"
        lines = [
            f"the passes took {min(ratios):.2f}-{max(ratios):.2f} of the median pass's time; after them "
            f"the {self.width}-wide linears read {linears} and the weights {weights}"
        ]
        if not self.steady:
            lines.append(
                f"warning: this machine's speed moved by up to {self.spread:.0%} while calibrate timed "
                "it. The profile holds each figure's median, and a prediction is off by as much as the "
                "machine differs from them when the predicted work runs: calibrate again on an idle "
                'machine, or with more --passes (docs/simulator.md, "The host\'s speed").'
            )
        return "\n".join(lines)
