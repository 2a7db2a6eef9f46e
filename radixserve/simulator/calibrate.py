"""`radixserve calibrate`: a hardware profile of this machine, fitted so that the simulator predicts
measured runs, and (with --validate) its error on workloads the fit did not use.

1. Peaks: a bf16 matmul's FLOP/s and a large copy's bytes/s, measured here.
2. Calibration runs: a few prefill-heavy and decode-heavy batches through a real Engine, timed.
3. The fit: the scheduler's batching of a batch that all arrives at once does not depend on time,
   so each run's forwards are recorded once (the zero-cost executor) and the profile's
   efficiencies and overheads are searched on a grid for the least squared log error of
   sum(forward times) against the measured times.
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
    (1, 512, 1),
    (1, 1536, 1),
    (4, 384, 1),
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
FORWARD_OVERHEAD_S = np.array([0.0, 0.25e-3, 0.5e-3, 1e-3, 2e-3, 4e-3, 8e-3])
TOKEN_OVERHEAD_S = np.array([0.0, 10e-6, 25e-6, 50e-6, 100e-6, 200e-6])


def measure_peaks(seconds: float = 1.0) -> tuple[float, float]:
    """(bf16 matmul FLOP/s, copy bytes/s) on this machine's CPU threads."""
    a = torch.randn(1024, 1024, dtype=torch.bfloat16)
    b = torch.randn(1024, 1024, dtype=torch.bfloat16)
    flops = _rate(lambda: torch.mm(a, b), 2 * 1024**3, seconds)
    src = torch.empty(64 * 2**20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    bandwidth = _rate(lambda: dst.copy_(src), 2 * src.numel(), seconds)  # read + write
    return flops, bandwidth


def _rate(work: Any, units: float, seconds: float) -> float:
    work()
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        work()
        done += 1
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


def measure_runs(engine: Any, repeats: int = 2) -> list[Run]:
    """Times each calibration run through the engine (cold cache, median of repeats)."""
    out = []
    for i, shape in enumerate(calibration_runs(engine.context_len)):
        params = {"temperature": 0.0, "max_new_tokens": shape[2], "ignore_eos": True}
        batch = prompts(shape, engine.vocab_size, seed=i)
        times = []
        for _ in range(repeats):
            engine.flush_cache()
            start = time.perf_counter()
            engine.generate(input_ids=batch, sampling_params=params)
            times.append(time.perf_counter() - start)
        out.append(Run(*shape, statistics.median(times)))
    return out


def recorded_forwards(
    config: ModelConfig, trace: list[TraceRequest], max_total_tokens: int, **server_args: Any
) -> list[ForwardRecord]:
    """The forwards the real scheduler runs for a trace that all arrives at t=0."""
    result = simulate(config, None, trace, max_total_tokens, **server_args)
    assert result.requests == len(trace)
    return result.records


def fit(
    config: ModelConfig,
    runs: list[Run],
    forwards: list[list[ForwardWork]],
    peak_flops: float,
    bandwidth: float,
    memory_bytes: float,
    name: str = "cpu",
) -> HardwareProfile:
    """The grid point with the least squared log error; forwards: per run, each forward's work."""
    measured = np.log(np.array([r.seconds for r in runs]))
    # One row per forward, and the run it belongs to.
    linear = np.array([w.linear_flops for run in forwards for w in run]) / peak_flops
    attention = np.array([w.attention_flops for run in forwards for w in run]) / peak_flops
    moved = np.array([w.bytes for run in forwards for w in run]) / bandwidth
    owner = np.repeat(np.arange(len(forwards)), [len(run) for run in forwards])
    counts = np.array([len(run) for run in forwards], dtype=float)
    tokens = np.array([sum(w.tokens for w in run) for run in forwards], dtype=float)
    best: tuple[float, HardwareProfile] | None = None
    for ef, ea, eb in itertools.product(FLOPS_EFFICIENCY, ATTENTION_EFFICIENCY, BANDWIDTH_EFFICIENCY):
        per_forward = np.maximum(linear / ef + attention / ea, moved / eb)
        roof = np.bincount(owner, weights=per_forward, minlength=len(forwards))
        # Every (forward, token) overhead pair at once: [runs, forward overheads, token overheads].
        predicted = (
            roof[:, None, None]
            + counts[:, None, None] * FORWARD_OVERHEAD_S[None, :, None]
            + tokens[:, None, None] * TOKEN_OVERHEAD_S[None, None, :]
        )
        error = ((np.log(predicted) - measured[:, None, None]) ** 2).mean(axis=0)
        i, j = np.unravel_index(int(np.argmin(error)), error.shape)
        if best is None or error[i, j] < best[0]:
            profile = HardwareProfile(
                name,
                peak_flops,
                bandwidth,
                memory_bytes,
                float(ef),
                float(eb),
                float(FORWARD_OVERHEAD_S[i]),
                float(TOKEN_OVERHEAD_S[j]),
                note="fitted by radixserve calibrate",
                attention_efficiency=float(ea),
            )
            best = (float(error[i, j]), profile)
    assert best is not None
    return best[1]


def forward_costs(config: ModelConfig, records: list[ForwardRecord]) -> list[ForwardWork]:
    shape = ModelShape.of(config)
    return [forward_work(shape, r.shape) for r in records]
