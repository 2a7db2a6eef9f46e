"""`radixserve calibrate`: a hardware profile of this machine, fitted so that the simulator predicts
measured runs, and (with --validate) its error on workloads the fit did not use.

1. Peaks: a bf16 matmul's FLOP/s and a large copy's bytes/s, measured here.
2. Calibration runs: a few prefill-heavy and decode-heavy batches through a real Engine, timed.
3. The fit: the scheduler's batching of a batch that all arrives at once does not depend on time,
   so each run's forwards are recorded once (the zero-cost executor) and the profile's
   efficiencies and overheads are searched (a grid, then a pattern search) for the least squared
   log error of sum(forward times) against the measured times.
"""

from __future__ import annotations

import itertools
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from radixserve.models.config import ModelConfig
from radixserve.simulator.cost_model import ForwardWork, ModelShape, forward_work
from radixserve.simulator.executor import ForwardRecord
from radixserve.simulator.hardware import HardwareProfile
from radixserve.simulator.simulate import simulate
from radixserve.simulator.trace import TraceRequest

# (requests, prompt tokens, output tokens): prefill-bound, then decode-bound shapes.
CALIBRATION_RUNS: tuple[tuple[int, int, int], ...] = (
    (1, 64, 1),  # a short prefill shows a prefill forward's fixed cost
    (1, 256, 1),
    (1, 512, 1),
    (1, 1536, 1),
    (4, 384, 1),
    (8, 512, 1),
    (1, 64, 48),
    (8, 64, 48),
    (32, 64, 32),
)


def calibration_runs(context_len: int) -> list[tuple[int, int, int]]:
    """CALIBRATION_RUNS with prompts shortened to what the model's context holds."""
    return [(n, min(p, context_len - out - 8), out) for n, p, out in CALIBRATION_RUNS]


FLOPS_EFFICIENCY = np.geomspace(0.05, 2.0, 24)
# Attention (softmax, small per-head matmuls) may run far below the linears' efficiency.
ATTENTION_EFFICIENCY = np.geomspace(0.005, 2.0, 20)
BANDWIDTH_EFFICIENCY = np.geomspace(0.05, 2.0, 24)
# Up to 64 ms: on a GPU a small model's forward can be bound by the host (launches, Python).
FORWARD_OVERHEAD_S = np.concatenate([[0.0], np.geomspace(0.1e-3, 64e-3, 19)])
# Per row that samples (a request's next token). Fitted per row, not per new token: the host's
# per-request work is the same for a prefill's hundreds of tokens as for a decode step's one.
ROW_OVERHEAD_S = np.array([0.0, 10e-6, 25e-6, 50e-6, 100e-6, 200e-6, 400e-6])


def measure_peaks(device: torch.device | None = None, seconds: float = 1.0) -> tuple[float, float]:
    """(bf16 matmul FLOP/s, copy bytes/s) on `device` (default: this machine's CPU threads). A GPU
    gets operands large enough to fill it."""
    device = device or torch.device("cpu")
    n, copy_bytes = (8192, 1 << 30) if device.type == "cuda" else (1024, 64 << 20)
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    flops = _rate(lambda: torch.mm(a, b), 2 * n**3, seconds, device)
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    bandwidth = _rate(lambda: dst.copy_(src), 2 * src.numel(), seconds, device)  # read + write
    return flops, bandwidth


def _rate(work: Any, units: float, seconds: float, device: torch.device) -> float:
    # A GPU runs work asynchronously: time whole batches of it, each ended by a synchronize.
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    batch = 10 if device.type == "cuda" else 1
    work()
    sync()
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(batch):
            work()
        sync()
        done += batch
    return units * done / (time.perf_counter() - start)


@dataclass(frozen=True)
class Run:
    requests: int
    prompt_len: int
    output_len: int
    seconds: float


def prompts(run: tuple[int, int, int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    requests, prompt_len, _ = run
    return [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(requests)]


def measure_runs(engine: Any, repeats: int = 3) -> list[Run]:
    """Times each calibration run through the engine, cold cache: the median of `repeats` (as the
    workloads the profile predicts are measured). A first untimed pass runs every shape once (a
    device's first forwards of a shape pay one-off setup: kernel selection, scratch buffers
    growing, pages touched for the first time). Then each timed pass runs every shape in turn, so
    that a slow spell of the machine (other work on a shared host) slows one repeat of several
    shapes, which the median drops, rather than every repeat of one shape."""
    shapes = calibration_runs(engine.context_len)
    batches = [prompts(shape, engine.vocab_size, seed=i) for i, shape in enumerate(shapes)]
    times: list[list[float]] = [[] for _ in shapes]
    for _ in range(1 + repeats):
        for shape, batch, shape_times in zip(shapes, batches, times, strict=True):
            params = {"temperature": 0.0, "max_new_tokens": shape[2], "ignore_eos": True}
            engine.flush_cache()
            results = engine.generate(input_ids=batch, sampling_params=params)
            # The scheduler's own span, arrival to the last finish (what the simulator predicts),
            # without the call's round trip through the engine's processes.
            shape_times.append(max(r["meta_info"]["e2e_latency"] for r in results))
    return [Run(*shape, statistics.median(t[1:])) for shape, t in zip(shapes, times, strict=True)]


def recorded_forwards(
    config: ModelConfig, trace: list[TraceRequest], max_total_tokens: int, **server_args: Any
) -> list[ForwardRecord]:
    """The forwards the real scheduler runs for a trace that all arrives at t=0."""
    # With the reads a cascade shares: the fit decides whether the engine's attention has one.
    result = simulate(config, None, trace, max_total_tokens, count_shared_reads=True, **server_args)
    assert result.requests == len(trace)
    return result.records


@dataclass(frozen=True)
class _Forwards:
    """Every calibration run's forwards as arrays, one entry per forward: its linears' and
    attention's seconds at 100% of the peak FLOP/s, its bytes' seconds at 100% of the bandwidth,
    whether it is a decode step, its sampling rows, and the run it belongs to."""

    linear: np.ndarray
    attention: np.ndarray
    moved: np.ndarray
    decode: np.ndarray
    rows: np.ndarray
    owner: np.ndarray
    runs: int

    @classmethod
    def of(
        cls, forwards: list[list[ForwardWork]], peak_flops: float, bandwidth: float, cascade: bool
    ) -> _Forwards:
        every = [w for run in forwards for w in run]
        return cls(
            np.array([w.linear_flops for w in every]) / peak_flops,
            np.array([w.attention_flops for w in every]) / peak_flops,
            np.array([w.bytes - w.shared_bytes * cascade for w in every]) / bandwidth,
            np.array([w.decode for w in every], dtype=bool),
            np.array([w.rows for w in every], dtype=float),
            np.repeat(np.arange(len(forwards)), [len(run) for run in forwards]),
            len(forwards),
        )

    def run_seconds(self, p: np.ndarray) -> np.ndarray:
        """Each run's predicted seconds for the parameters `p` (as in _PARAMETERS)."""
        flops, attention, bandwidth, decode_flops, prefill_fixed, decode_fixed, row = p
        linear = self.linear / np.where(self.decode, decode_flops, flops)
        per_forward = np.maximum(linear + self.attention / attention, self.moved / bandwidth)
        per_forward += np.where(self.decode, decode_fixed, prefill_fixed) + self.rows * row
        return np.bincount(self.owner, weights=per_forward, minlength=self.runs)


# The fitted parameters, in order: efficiencies (searched by ratios) then fixed costs in seconds
# (searched by steps).
_PARAMETERS = ("flops", "attention", "bandwidth", "decode_flops", "prefill_fixed", "decode_fixed", "row")
_EFFICIENCIES = 4
_EFFICIENCY_BOUNDS = (0.002, 4.0)
_FIXED_BOUNDS = (0.0, 0.25)


def fit(
    config: ModelConfig,
    runs: list[Run],
    forwards: list[list[ForwardWork]],
    peak_flops: float,
    bandwidth: float,
    memory_bytes: float,
    name: str = "cpu",
    cascade: bool = False,
) -> HardwareProfile:
    """The profile with the least squared log error of each run's predicted against measured
    seconds; forwards: per run, each forward's work; cascade: whether the engine's attention reads
    a shared prefix once per batch. A coarse grid finds the basin, then a pattern search refines
    every parameter: the grid's steps (17% between efficiencies) alone would leave errors of the
    size of the 9% target."""
    data = _Forwards.of(forwards, peak_flops, bandwidth, cascade)
    measured = np.log(np.array([r.seconds for r in runs]))

    def error(p: np.ndarray) -> float:
        return float(((np.log(data.run_seconds(p)) - measured) ** 2).mean())

    p = _polish(error, _coarse_grid(data, measured))
    # The fixed costs' additive steps leave rounding residue (1e-20 s for a cost the search took
    # to 0): to the nanosecond.
    p[_EFFICIENCIES:] = np.round(p[_EFFICIENCIES:], 9)
    flops, attention, eb, decode_flops, prefill_fixed, decode_fixed, row = (float(x) for x in p)
    return HardwareProfile(
        name,
        peak_flops,
        bandwidth,
        memory_bytes,
        flops,
        eb,
        prefill_fixed,
        token_overhead_s=0.0,  # per row instead
        note="fitted by radixserve calibrate",
        attention_efficiency=attention,
        decode_overhead_s=decode_fixed,
        cascade_attention=cascade,
        row_overhead_s=row,
        decode_flops_efficiency=decode_flops,
    )


def _coarse_grid(data: _Forwards, measured: np.ndarray) -> np.ndarray:
    """The best point of the grids above, a decode step's linears at the prefill's efficiency."""
    decodes = np.bincount(data.owner, weights=data.decode, minlength=data.runs)
    prefills = np.bincount(data.owner, minlength=data.runs) - decodes
    rows = np.bincount(data.owner, weights=data.rows, minlength=data.runs)
    overhead = FORWARD_OVERHEAD_S
    # Every (prefill overhead, decode overhead, row overhead) triple at once:
    # [runs, prefill overheads, decode overheads, row overheads].
    fixed = (
        prefills[:, None, None, None] * overhead[None, :, None, None]
        + decodes[:, None, None, None] * overhead[None, None, :, None]
        + rows[:, None, None, None] * ROW_OVERHEAD_S[None, None, None, :]
    )
    best: tuple[float, np.ndarray] | None = None
    for ef, ea, eb in itertools.product(FLOPS_EFFICIENCY, ATTENTION_EFFICIENCY, BANDWIDTH_EFFICIENCY):
        per_forward = np.maximum(data.linear / ef + data.attention / ea, data.moved / eb)
        roof = np.bincount(data.owner, weights=per_forward, minlength=data.runs)
        predicted = roof[:, None, None, None] + fixed
        error = ((np.log(predicted) - measured[:, None, None, None]) ** 2).mean(axis=0)
        i, j, k = np.unravel_index(int(np.argmin(error)), error.shape)
        if best is None or error[i, j, k] < best[0]:
            point = np.array([ef, ea, eb, ef, overhead[i], overhead[j], ROW_OVERHEAD_S[k]])
            best = (float(error[i, j, k]), point)
    assert best is not None
    return best[1]


def _polish(error: Any, start: np.ndarray, rounds: int = 200) -> np.ndarray:
    """A pattern search from `start`: each parameter in turn moves up or down by its step while
    that lowers the error; when none does, the steps halve. Efficiencies move by ratios, fixed
    costs by steps of seconds; both stay within their bounds."""
    p, best = start.copy(), error(start)
    ratio = np.full(_EFFICIENCIES, 0.16)  # log-steps, about the coarse grid's
    step = np.maximum(start[_EFFICIENCIES:] * 0.4, [200e-6, 200e-6, 20e-6])
    for _ in range(rounds):
        moved = False
        for i in range(len(_PARAMETERS)):
            for sign in (1.0, -1.0):
                q = p.copy()
                if i < _EFFICIENCIES:
                    q[i] = np.clip(p[i] * np.exp(sign * ratio[i]), *_EFFICIENCY_BOUNDS)
                else:
                    q[i] = np.clip(p[i] + sign * step[i - _EFFICIENCIES], *_FIXED_BOUNDS)
                if (e := error(q)) < best:
                    p, best, moved = q, e, True
        if not moved:
            ratio, step = ratio / 2, step / 2
            if ratio[0] < 1e-3:  # ratios within 0.1%
                break
    return p


def forward_costs(config: ModelConfig, records: list[ForwardRecord]) -> list[ForwardWork]:
    shape = ModelShape.of(config)
    return [forward_work(shape, r.shape) for r in records]
