"""Each part of the engine's own forwards timed in place, beside the cost model's term for it: the
linears, attention, norms, rotary embedding and activation of a replayed trace's prefills and
extends on a CPU model runner's native kernels, and the rest of each forward (its embedding, the
KV writes, Python, the scheduler's time before it).

calibrate fits a profile on whole runs' times, so one of its terms may absorb another's error
and still fit the calibration model: a term that is off by a share of the linears' time moves
with the model's width, and misprices another model (docs/simulator.md). Timing the parts shows
which term is off. A decode step runs every layer in one native call (models/fused_decode.py),
so its parts cannot be timed apart, and decode steps are left out.

The kernels are timed on the CPU's wall clock, which is exact there because they run
synchronously. A GPU's kernels run asynchronously, and the timer refuses a runner without the
native CPU kernels."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from radixserve.config.server_args import ServerArgs
from radixserve.executor.model_runner import ModelRunner
from radixserve.models.config import ModelConfig
from radixserve_tools.simulator.cost_model import (
    ModelShape,
    compute_terms,
    forward_seconds,
    profile_work,
    wake_seconds,
)
from radixserve_tools.simulator.executor import ForwardRecord
from radixserve_tools.simulator.hardware import HardwareProfile
from radixserve_tools.simulator.replay import measured_step_seconds, replay
from radixserve_tools.simulator.trace import TraceRequest

# The parts timed (ComputeTerms' fields), and the runner's methods each is timed on.
PARTS = ("linear", "attention", "norm", "rotary", "activation")
_KERNEL_METHODS = {"linear": "linear", "rms_norm": "norm", "rotary_": "rotary", "silu_and_mul": "activation"}
_ATTENTION_METHODS = ("extend", "decode", "verify")


@dataclass(frozen=True)
class ForwardParts:
    """One forward's seconds: the whole (runner.forward) and each of PARTS within it."""

    forward: float
    parts: dict[str, float]


@dataclass
class PartTimer:
    """While entered, times every call of the native kernels and the attention backend that a
    model runner's forwards make, per forward (`forwards`, in order). It patches the runner's own
    kernel and backend objects, and unpatches them on exit. A timed call inside another (none
    today) counts once, in the outer one's part."""

    runner: ModelRunner
    forwards: list[ForwardParts] = field(default_factory=list)
    _patched: list[tuple[object, str]] = field(default_factory=list)
    _current: dict[str, float] = field(default_factory=dict)
    _depth: int = 0

    def __enter__(self) -> PartTimer:
        kernels, attention = self.runner.kernels, self.runner.attention
        if kernels is None or attention is None:
            raise ValueError("parts are timed on the native CPU kernels and an attention backend")
        for name, part in _KERNEL_METHODS.items():
            self._patch(kernels, name, functools.partial(self._timed, part))
        for name in _ATTENTION_METHODS:
            self._patch(attention, name, functools.partial(self._timed, "attention"))
        self._patch(self.runner, "forward", self._forward)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        for owner, name in self._patched:
            delattr(owner, name)  # the class's method shows through again
        self._patched.clear()

    def _patch(self, owner: object, name: str, wrapper: Callable[..., Any]) -> None:
        method = getattr(owner, name)
        setattr(owner, name, functools.partial(wrapper, method))
        self._patched.append((owner, name))

    def _timed(self, part: str, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self._depth += 1
        began = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            self._depth -= 1
            if not self._depth:
                self._current[part] = self._current.get(part, 0.0) + time.perf_counter() - began

    def _forward(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self._current = dict.fromkeys(PARTS, 0.0)
        began = time.perf_counter()
        out = method(*args, **kwargs)
        self.forwards.append(ForwardParts(time.perf_counter() - began, self._current))
        return out


def time_parts(
    args: ServerArgs, trace: Sequence[TraceRequest], runner: ModelRunner
) -> list[tuple[ForwardRecord, ForwardParts]]:
    """`trace` replayed on `runner` (simulator/replay.py), each recorded forward with its parts."""
    with PartTimer(runner) as timer:
        result = replay(args, trace, runner=runner)
    # The replay's warm-up forwards come first and are not recorded.
    timed = timer.forwards[len(timer.forwards) - len(result.records) :]
    return list(zip(result.records, timed, strict=True))


@dataclass(frozen=True)
class PartRow:
    """A part's seconds over the compared forwards, measured and as a profile predicts them."""

    part: str
    measured_s: float
    predicted_s: float

    @property
    def error(self) -> float:
        return self.predicted_s / self.measured_s - 1


def compare_parts(
    config: ModelConfig, profile: HardwareProfile, timed: list[tuple[ForwardRecord, ForwardParts]]
) -> list[PartRow]:
    """Each of PARTS summed over `timed`'s prefills and extends, measured against `profile`'s
    terms for them (cost_model.compute_terms); then "rest": the forwards' measured step (the
    scheduler's time before each included: replay.measured_step_seconds) less its parts, against
    the profile's memory time and fixed costs; last "forward", the whole."""
    model = ModelShape.of(config)
    measured = dict.fromkeys((*PARTS, "rest", "forward"), 0.0)
    predicted = dict(measured)
    for record, parts in timed:
        if record.shape.decode:
            continue
        step = measured_step_seconds(record)
        terms = compute_terms(profile_work(model, record.shape, profile), profile)
        whole = forward_seconds(model, profile, record.shape) + wake_seconds(profile, record.idle_s)
        for part in PARTS:
            measured[part] += parts.parts[part]
            predicted[part] += getattr(terms, part)
        measured["rest"] += step - sum(parts.parts.values())
        predicted["rest"] += whole - terms.total
        measured["forward"] += step
        predicted["forward"] += whole
    return [PartRow(part, measured[part], predicted[part]) for part in measured]
