"""Each part of the engine's forwards timed in place (simulator/components.py): the timer sees
every part of every prefill and extend, leaves the runner as it was, and the comparison sums the
parts and the rest to the whole on both sides."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from radixserve.config.server_args import ServerArgs
from radixserve.executor.model_runner import ModelRunner
from radixserve.executor.runner_config import RunnerConfig
from radixserve.models.source import load_model_config, resolve_model_source
from radixserve_tools.simulator.components import PARTS, PartTimer, compare_parts, time_parts
from radixserve_tools.simulator.cost_model import ModelShape, forward_seconds
from radixserve_tools.simulator.hardware import BUILTIN_PROFILES, HardwareProfile, PointwiseCosts
from tests.simulator.test_replay import _trace


def _args(model: Path, **flags: Any) -> ServerArgs:
    flags = {"dtype": "bfloat16", "max_total_tokens": 2048, "log_level": "warning", **flags}
    return ServerArgs(model_path=str(model), **flags)


@pytest.fixture
def runner(tiny_model_dir: Callable[[str], Path]) -> Iterator[ModelRunner]:
    runner = ModelRunner(RunnerConfig.from_server_args(_args(tiny_model_dir("llama"))))
    yield runner
    runner.close()


def test_every_part_of_each_prefill_is_timed_within_its_forward(
    tiny_model_dir: Callable[[str], Path], runner: ModelRunner
) -> None:
    args = _args(tiny_model_dir("llama"))
    kernels, attention = runner.kernels, runner.attention
    timed = time_parts(args, _trace(), runner)  # the replay ends with the scheduler's KV check
    prefills = [(record, parts) for record, parts in timed if not record.shape.decode]
    assert prefills and len(prefills) < len(timed)  # the trace's decode steps are there too
    for _, forward in prefills:
        assert all(forward.parts[part] > 0 for part in PARTS)
        assert sum(forward.parts.values()) < forward.forward
    # Each recorded forward is paired with its own timing: the forward's time within the step
    # the replay recorded for it.
    assert all(parts.forward <= record.seconds for record, parts in timed)
    # The runner is as it was: its kernels' and backend's own methods, unwrapped.
    assert runner.kernels is kernels and runner.attention is attention
    assert not {"linear", "rms_norm", "rotary_", "silu_and_mul"} & set(vars(kernels))
    assert not {"extend", "decode", "verify"} & set(vars(attention)) and "forward" not in vars(runner)


def test_the_comparison_sums_parts_and_rest_to_the_whole(
    tiny_model_dir: Callable[[str], Path], runner: ModelRunner
) -> None:
    model = tiny_model_dir("llama")
    timed = time_parts(_args(model), _trace(), runner)
    config = load_model_config(resolve_model_source(str(model)))
    pointwise = PointwiseCosts(norm_s=1e-9, rotary_s=2e-9, activation_s=3e-9)
    profile = HardwareProfile("cpu", 1e11, 2e10, 1e10, 0.8, 1.0, 5e-3, pointwise=pointwise, idle_wake_s=1e-3)
    rows = compare_parts(config, profile, timed)
    assert [row.part for row in rows] == [*PARTS, "rest", "forward"]
    *parts, whole = rows
    assert sum(row.measured_s for row in parts) == pytest.approx(whole.measured_s)
    assert sum(row.predicted_s for row in parts) == pytest.approx(whole.predicted_s)
    shape = ModelShape.of(config)
    prefills = [record for record, _ in timed if not record.shape.decode]
    assert whole.predicted_s >= sum(forward_seconds(shape, profile, r.shape) for r in prefills)
    assert all(row.predicted_s > 0 for row in rows)
    # A profile without pointwise costs predicts none.
    h100 = compare_parts(config, BUILTIN_PROFILES["H100"], timed)
    no_pointwise = {row.part: row.predicted_s for row in h100}
    assert no_pointwise["norm"] == no_pointwise["rotary"] == no_pointwise["activation"] == 0.0


def test_the_timer_needs_the_native_kernels(tiny_model_dir: Callable[[str], Path]) -> None:
    """Parts are timed on the CPU's native kernels, which run synchronously: a runner on torch's
    ops has none to time."""
    runner = ModelRunner(RunnerConfig.from_server_args(_args(tiny_model_dir("llama"), cpu_kernels="torch")))
    try:
        with pytest.raises(ValueError, match="native CPU kernels"), PartTimer(runner):
            pass
    finally:
        runner.close()
