"""The runs `radixserve calibrate` times, and how: the calibration shapes (batches that arrive at
once, some over prefixes cached beforehand, one after an idle spell), their batches of token
ids, and the timed passes over them through a real Engine (CalibrationTimer), each shape's
samples made a Run. calibrate.py fits a profile to these runs."""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class CalibrationShape:
    """A batch that arrives at once: `requests` prompts of `prompt_len` new tokens each, after a
    `cached_prefix` they share that an untimed request put in the cache, each generating
    `output_len` tokens; `idle_s` after the request before it (the engine idle meanwhile).
    With `prefix_groups` above 1, that many distinct prefixes of `cached_prefix` tokens, the
    requests taking them in turn: no prefix is then the whole batch's, as in a server whose
    requests come from several system prompts at once."""

    requests: int
    prompt_len: int
    output_len: int
    cached_prefix: int = 0
    idle_s: float = 0.0
    prefix_groups: int = 1

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> CalibrationShape:
        """The shape of a saved run (a validation's JSON row: its fields and others, ignored)."""
        return cls(**{f.name: row[f.name] for f in dataclasses.fields(cls) if f.name in row})

    @property
    def label(self) -> str:
        groups = f"{self.prefix_groups} x " if self.prefix_groups > 1 else ""
        over = f" over {groups}{self.cached_prefix} cached" if self.cached_prefix else ""
        idle = f", after {self.idle_s:g} s idle" if self.idle_s else ""
        return f"{self.requests} x {self.prompt_len}{over} + {self.output_len}{idle}"


# How long the engine idles before the calibration run that times a forward after idling
# (HardwareProfile.idle_wake_s): on this CPU a second's idle slowed the next forward about as much
# as longer ones did (docs/simulator.md).
WAKE_IDLE_S = 1.0


# Prefill-bound, then decode-bound shapes, then shapes whose attention reads a long context from
# the KV pool (an extend over a cached prefix, decode steps at a thousand tokens): what requests
# with a shared system prompt or a long conversation run, at their own efficiency.
CALIBRATION_RUNS: tuple[CalibrationShape, ...] = (
    CalibrationShape(1, 64, 1),  # a short prefill shows a prefill forward's fixed cost
    CalibrationShape(1, 256, 1),
    CalibrationShape(1, 512, 1),
    CalibrationShape(1, 1536, 1),
    CalibrationShape(4, 384, 1),
    CalibrationShape(8, 512, 1),
    CalibrationShape(1, 64, 48),
    CalibrationShape(8, 64, 48),
    CalibrationShape(32, 64, 32),
    CalibrationShape(1, 64, 1, cached_prefix=512),  # the extend alone, apart from decode steps
    CalibrationShape(1, 64, 32, cached_prefix=512),
    CalibrationShape(4, 64, 32, cached_prefix=512),
    CalibrationShape(16, 16, 16, cached_prefix=1024),  # a cascade's cost per key and per query
    CalibrationShape(2, 1024, 32),
    # Decode steps over long contexts that no whole batch shares (no cascade), with little prefill
    # before them: the runs above show a decode step's attention over its context only beside a
    # long prefill, which then outweighs it in the fit.
    CalibrationShape(8, 16, 48, cached_prefix=512, prefix_groups=4),
    CalibrationShape(2, 16, 48, cached_prefix=1024, prefix_groups=2),
    # The extend above once more, after the engine idled: what a request arriving at an idle
    # server pays more (HardwareProfile.idle_wake_s). Not in the fit of the rest.
    CalibrationShape(1, 64, 1, cached_prefix=512, idle_s=WAKE_IDLE_S),
)


def calibration_runs(
    context_len: int, shapes: Sequence[CalibrationShape] = CALIBRATION_RUNS
) -> list[CalibrationShape]:
    """`shapes` with prompts (and cached prefixes) shortened to what the model's context holds."""
    runs = []
    for shape in shapes:
        room = context_len - shape.output_len - 8
        prefix = min(shape.cached_prefix, room // 2)
        prompt_len = min(shape.prompt_len, room - prefix)
        runs.append(dataclasses.replace(shape, prompt_len=prompt_len, cached_prefix=prefix))
    return runs


@dataclass(frozen=True)
class Run:
    shape: CalibrationShape
    seconds: float
    # How the run's repeats within a pass spread: the sum of their logs' squared deviations from
    # each pass's mean, and its degrees of freedom (0: timed once per pass).
    log_squares: float = 0.0
    log_df: int = 0


@dataclass(frozen=True)
class CalibrationBatch:
    """A shape's token ids: the cached prefixes (none if the shape has none) and the timed
    prompts, each starting with one of them."""

    prefixes: list[list[int]]
    prompts: list[list[int]]


def calibration_batch(shape: CalibrationShape, vocab: int, seed: int) -> CalibrationBatch:
    rng = random.Random(seed)
    groups = shape.prefix_groups if shape.cached_prefix else 0
    prefixes = [[rng.randrange(3, vocab) for _ in range(shape.cached_prefix)] for _ in range(groups)]
    tails = [[rng.randrange(3, vocab) for _ in range(shape.prompt_len)] for _ in range(shape.requests)]
    prompts = [prefixes[i % groups] + tail if prefixes else tail for i, tail in enumerate(tails)]
    return CalibrationBatch(prefixes, prompts)


# A pass times each run until about this long is spent on it (at most MAX_SAMPLES times): a
# short run's time is noisier, relative to itself, than a long run's.
SAMPLE_S = 1.0
MAX_SAMPLES = 5
# The untimed request each pass starts with.
PASS_WARMUP_TOKENS = 16


def samples_for(seconds: float, budget_s: float = SAMPLE_S) -> int:
    """How many times to time a run that took `seconds` to spend about `budget_s` on it."""
    return min(MAX_SAMPLES, max(1, round(budget_s / seconds)))


class CalibrationTimer:
    """Times the calibration runs through an engine, cold cache, in passes: each run's time is the
    median over the timed passes (as the workloads the profile predicts are measured).

    - `start` runs every shape once untimed: a device's first forwards of a shape pay one-off
      setup (kernel selection, scratch buffers growing, pages touched for the first time). Its
      times also set how many samples a pass takes of each run (SAMPLE_S); a pass's time for a
      run is the median of its samples.
    - Each pass runs every shape in turn, so that a slow spell of the machine (other work on a
      shared host) slows one pass of several shapes, which the median drops, rather than every
      repeat of one shape.
    - Each pass starts with a short untimed request, so that its first sample does not pay for
      what ran before it (the caller's other work, or the engine idling: the wake cost). It did
      not explain why the first run's samples spread more than the other single-forward runs'
      (docs/simulator.md).
    - A caller may do other work between passes. simulator_validation.py times its workloads
      between them, so that the machine's slow and fast spells weigh on the calibration as on the
      measurements it predicts."""

    def __init__(
        self,
        engine: Any,
        sleep: Callable[[float], None] = time.sleep,
        shapes: Sequence[CalibrationShape] = CALIBRATION_RUNS,
    ) -> None:
        self.engine = engine
        self._sleep = sleep
        self.shapes = calibration_runs(engine.context_len, shapes)
        self._batches = [calibration_batch(s, engine.vocab_size, seed=i) for i, s in enumerate(self.shapes)]
        self.samples = [1] * len(self.shapes)
        # One list per timed pass, each with every shape's seconds (the median of its samples).
        self.passes: list[list[float]] = []
        # The same passes' every sample of every shape.
        self.pass_samples: list[list[list[float]]] = []

    @classmethod
    def start(
        cls,
        engine: Any,
        sleep: Callable[[float], None] = time.sleep,
        shapes: Sequence[CalibrationShape] = CALIBRATION_RUNS,
    ) -> CalibrationTimer:
        timer = cls(engine, sleep, shapes)
        first = timer._run_pass()  # one sample each
        timer.samples = [samples_for(seconds) for (seconds,) in first]
        return timer

    def time_pass(self) -> list[float]:
        samples = self._run_pass()
        self.pass_samples.append(samples)
        self.passes.append([statistics.median(times) for times in samples])
        return self.passes[-1]

    def runs(self, passes: Sequence[int] | None = None) -> list[Run]:
        """Each run as the timed passes measured it (all of them, or those numbered `passes`)."""
        if not self.passes:
            raise ValueError("no calibration pass has been timed")
        return timed_runs(self.shapes, self.pass_samples, passes)

    def _run_pass(self) -> list[list[float]]:
        # One short request, untimed, first (see the class's docstring).
        self.engine.generate(
            input_ids=self._batches[0].prompts[0][:PASS_WARMUP_TOKENS], sampling_params=_params(1)
        )
        return [
            [self._time_run(shape, batch) for _ in range(samples)]
            for shape, batch, samples in zip(self.shapes, self._batches, self.samples, strict=True)
        ]

    def _time_run(self, shape: CalibrationShape, batch: CalibrationBatch) -> float:
        self.engine.flush_cache()
        for prefix in batch.prefixes:
            self.engine.generate(input_ids=prefix, sampling_params=_params(1))
        if shape.idle_s:
            self._sleep(shape.idle_s)
        results = self.engine.generate(input_ids=batch.prompts, sampling_params=_params(shape.output_len))
        # The scheduler's own span, arrival to the last finish (what the simulator predicts),
        # without the call's round trip through the engine's processes.
        return float(max(r["meta_info"]["e2e_latency"] for r in results))


def timed_runs(
    shapes: Sequence[CalibrationShape],
    pass_samples: Sequence[Sequence[Sequence[float]]],
    passes: Sequence[int] | None = None,
) -> list[Run]:
    """Each shape's Run from timed passes' samples (per pass, per shape, every sample; as
    CalibrationTimer.pass_samples, which a validation saves): its seconds the median over the
    passes of each pass's median, and the spread of its samples within each pass. `passes`: the
    passes to use (all by default): a validation fits one profile per round on the passes timed
    next to it, apart from the host's drift over the rest (docs/simulator.md)."""
    chosen = [pass_samples[k] for k in (range(len(pass_samples)) if passes is None else passes)]
    if not chosen:
        raise ValueError("no calibration pass chosen")
    out = []
    for i, shape in enumerate(shapes):
        squares, df = 0.0, 0
        for samples in chosen:
            logs = np.log(samples[i])
            squares += float(np.sum((logs - logs.mean()) ** 2))
            df += len(logs) - 1
        seconds = statistics.median(statistics.median(samples[i]) for samples in chosen)
        out.append(Run(shape, seconds, squares, df))
    return out


def neighbour_passes(round_: int, passes: int) -> list[int]:
    """The passes timed right before and right after round `round_` of a validation that times a
    pass before each round (and maybe one after the last): `passes` of them in all."""
    return [k for k in (round_, round_ + 1) if k < passes]


def spread_order(counts: Sequence[int]) -> list[tuple[int, int]]:
    """The order in which to time several runs' repeats within one round, as (run, repeat) pairs:
    run k's `counts[k]` repeats at even steps across the round rather than one after another, so
    that they meet different spells of a host whose speed jumps for seconds at a time (its matmul
    rate moved between 77 and 168 GFLOP/s in five minutes on the Zen 3, docs/simulator.md). Each
    repeat takes the middle of its share of the round; where two fall together, the run listed
    first goes first."""
    slots = [((i + 0.5) / count, run, i) for run, count in enumerate(counts) for i in range(count)]
    return [(run, i) for _, run, i in sorted(slots)]


def _params(output_len: int) -> dict[str, Any]:
    return {"temperature": 0.0, "max_new_tokens": output_len, "ignore_eos": True}
