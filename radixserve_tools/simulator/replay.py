"""Replaying a trace on the real model, on the wall clock: the simulator's own drive
(simulate.drive) with the model runner in place of the cost model. Every forward is timed and
recorded with the shape the cost model would be given, so a replay and a simulation of one trace
compare figure by figure, and each forward the real scheduler ran can be set against what the cost
model predicts for it (compare_forwards; benchmarks/simulator_validation.py --serving).

A replay runs the scheduler in this process, without the server's HTTP process, detokenizer and
sockets: what it measures beside the server's own figures tells the forwards' share of a gap
between measured and simulated from the rest's."""

from __future__ import annotations

import bisect
import dataclasses
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from radixserve.config.server_args import ServerArgs
from radixserve.executor.base import Executor
from radixserve.forward.batch import ForwardBatch
from radixserve.models.config import ModelConfig
from radixserve.protocol.messages import GenerateRequest
from radixserve.protocol.sampling_params import SamplingParams
from radixserve.scheduler.scheduler import Scheduler
from radixserve.scheduler.stats import IDLE_GAP_S, HostTimeLine
from radixserve_tools.simulator.cost_model import ModelShape, forward_seconds, wake_seconds
from radixserve_tools.simulator.executor import ForwardRecord, forward_shape
from radixserve_tools.simulator.hardware import HardwareProfile
from radixserve_tools.simulator.simulate import SimResult, drive
from radixserve_tools.simulator.trace import TraceRequest

# The warm-up request: a replay's first forwards would otherwise pay one-off costs (allocations,
# kernel set-up) that neither a server which has run a while nor the cost model has.
WARMUP_TOKENS = 64


@dataclass
class WallClock:
    """Seconds since the replay started."""

    origin: float = field(default_factory=time.perf_counter)

    @property
    def now(self) -> float:
        return time.perf_counter() - self.origin

    def advance_to(self, t: float) -> None:
        wait = t - self.now
        if wait > 0:
            time.sleep(wait)


class TimedExecutor:
    """The model runner, its forwards timed on the wall clock and recorded as the cost model's
    executor records them; everything else passes straight to the runner."""

    def __init__(self, runner: Executor, clock: WallClock, count_shared_reads: bool) -> None:
        self._runner = runner
        self._clock = clock
        self._count_shared_reads = count_shared_reads
        self._last_end = 0.0
        self._sync = runner.info.device.type == "cuda"
        self.records: list[ForwardRecord] = []

    def forward(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        start = self._clock.now
        out = self._runner.forward(batch)
        if self._sync:  # a GPU forward returns once queued; its time is when it is done
            torch.cuda.synchronize()
        end = self._clock.now
        shape = forward_shape(batch, self._count_shared_reads)
        self.records.append(ForwardRecord(start, end - start, batch.mode.name, shape, start - self._last_end))
        # The next forward's idle_s counts from here: the scheduler's own time between forwards,
        # without this recording's (finding shared prefixes costs host time the engine has not).
        self._last_end = self._clock.now
        return out

    def restart(self) -> None:
        """Forgets the records so far; the device counts as idle from now."""
        self.records.clear()
        self._last_end = self._clock.now

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)


def replay(
    args: ServerArgs,
    trace: Sequence[TraceRequest],
    count_shared_reads: bool = False,
    runner: Executor | None = None,
) -> SimResult:
    """Runs `trace` through a scheduler over the real model `args` names (or over `runner`), at its
    arrival times on the wall clock; count_shared_reads as for CostModelExecutor (it costs host
    time between forwards, so a replay that is timed leaves it off unless the profile cascades)."""
    owned = runner is None
    if runner is None:
        from radixserve.executor.model_runner import ModelRunner
        from radixserve.executor.runner_config import RunnerConfig

        runner = ModelRunner(RunnerConfig.from_server_args(args))
    vocab = runner.info.config.vocab_size
    # A trace's ids only shape the batches (shared prefixes); any model's vocabulary takes them.
    requests = [dataclasses.replace(r, input_ids=[t % vocab for t in r.input_ids]) for r in trace]
    clock = WallClock()
    timed = TimedExecutor(runner, clock, count_shared_reads)
    scheduler = Scheduler(args, cast(Executor, timed))
    try:
        if requests:
            _warm_up(scheduler, requests[0])
        clock.origin = time.perf_counter() - min((r.arrival_s for r in requests), default=0.0)
        timed.restart()
        return drive(scheduler, timed.records, requests, clock, runner.info.max_total_tokens)
    finally:
        if owned:
            runner.close()


def _warm_up(scheduler: Scheduler, first: TraceRequest) -> None:
    """One short request, then the cache flushed: the replay starts as cold as the trace did."""
    params = {"max_new_tokens": 2, "ignore_eos": True, "temperature": 0.0}
    scheduler.handle(
        GenerateRequest("warm-up", first.input_ids[:WARMUP_TOKENS], SamplingParams.from_dict(params))
    )
    while not scheduler.is_idle:
        scheduler.step()
    if not scheduler.flush_cache():
        raise RuntimeError("the scheduler could not flush its cache after the warm-up")


@dataclass(frozen=True)
class ForwardGroup:
    """Forwards of one kind: how many, their measured and predicted seconds in all, and how the
    log of each one's measured over predicted time spreads (its standard deviation; 0 for one
    forward): the forwards' noise, plus how far the cost model's error differs between the kind's
    shapes. Set beside the profile's forward_noise."""

    kind: str
    count: int
    measured_s: float
    predicted_s: float
    spread: float

    @property
    def error(self) -> float:
        return self.predicted_s / self.measured_s - 1 if self.measured_s else 0.0


# A forward after the device idled at least this long is grouped apart: it may pay a wake cost.
AFTER_IDLE_S = IDLE_GAP_S
# Decode steps are grouped by batch size: from each of these up to the next.
_DECODE_BATCHES = (1, 2, 5, 9, 17)
_DECODE_LABELS = ("1", "2-4", "5-8", "9-16", "17+")


def forward_kind(record: ForwardRecord) -> str:
    """A forward's group: a decode step by its batch size, a prefill by whether its requests had
    cached prefixes; either after an idle spell or not."""
    if record.mode == "DECODE":
        group = bisect.bisect_right(_DECODE_BATCHES, len(record.shape.q_lens)) - 1
        kind = f"decode, batch {_DECODE_LABELS[group]}"
    else:
        kind = "extend over a cached prefix" if any(record.shape.prefix_lens) else "prefill"
    return kind + (", after idle" if record.idle_s >= AFTER_IDLE_S else "")


def measured_step_seconds(record: ForwardRecord) -> float:
    """A replayed forward's measured time as the cost model prices it: the forward, and after
    another the scheduler's host time between the two (building the batch, processing the last
    one's outputs). A calibration run times both, and a simulation charges them to the forwards.
    After an idle spell the gap was idle: the forward alone."""
    return record.seconds + (record.idle_s if record.idle_s < AFTER_IDLE_S else 0.0)


def compare_forwards(
    records: list[ForwardRecord], config: ModelConfig, profile: HardwareProfile
) -> list[ForwardGroup]:
    """Each recorded forward's measured seconds (measured_step_seconds) against what `profile`
    predicts for its very shape and idle, summed per kind (forward_kind), in order of measured
    time."""
    model = ModelShape.of(config)
    groups: dict[str, list[tuple[float, float]]] = {}
    for record in records:
        predicted = forward_seconds(model, profile, record.shape) + wake_seconds(profile, record.idle_s)
        groups.setdefault(forward_kind(record), []).append((measured_step_seconds(record), predicted))
    out = [
        ForwardGroup(
            kind,
            len(pairs),
            sum(m for m, _ in pairs),
            sum(p for _, p in pairs),
            statistics.stdev(math.log(m / p) for m, p in pairs) if len(pairs) > 1 else 0.0,
        )
        for kind, pairs in groups.items()
    ]
    return sorted(out, key=lambda g: -g.measured_s)


@dataclass(frozen=True)
class HostTime:
    """The scheduler's time between two decode steps, back to back (the later one's idle_s:
    sampling, processing the last step's outputs, building the next batch), as a straight line in
    the step's rows: what a profile's decode_overhead_s and row_overhead_s price beside the
    forward's own. Measured apart from the forward, it splits a step's cost per row between the
    host and the model, which one model's calibration runs cannot (docs/simulator.md)."""

    fixed_s: float
    per_row_s: float
    steps: int

    def describe(self, profile: HardwareProfile) -> str:
        return (
            f"the scheduler's time between decode steps: {self.fixed_s * 1e3:.2f} ms + "
            f"{self.per_row_s * 1e6:.0f} us per row over {self.steps} steps (the profile charges "
            f"{profile.row_overhead_s * 1e6:.0f} us per sampled row)"
        )


def decode_host_time(records: Sequence[ForwardRecord]) -> HostTime | None:
    """HostTime over `records`' decode steps that followed another forward without an idle spell
    (the line the scheduler draws of its own: HostTimeLine); None without two batch sizes."""
    line = HostTimeLine()
    for r in records:
        if r.mode == "DECODE" and r.idle_s < AFTER_IDLE_S:
            line.add(len(r.shape.q_lens), r.idle_s)
    fitted = line.line()
    return None if fitted is None else HostTime(*fitted, line.steps)
