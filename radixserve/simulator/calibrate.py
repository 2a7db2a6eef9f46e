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


def measure_runs(engine: Any, repeats: int = 2) -> list[Run]:
    """Times each calibration run through the engine: cold cache, the fastest of `repeats` after
    one untimed run of the same shape (a device's first forwards of a shape pay one-off setup:
    kernel selection, scratch buffers growing, pages touched for the first time)."""
    out = []
    for i, shape in enumerate(calibration_runs(engine.context_len)):
        params = {"temperature": 0.0, "max_new_tokens": shape[2], "ignore_eos": True}
        batch = prompts(shape, engine.vocab_size, seed=i)
        times = []
        for _ in range(1 + repeats):
            engine.flush_cache()
            results = engine.generate(input_ids=batch, sampling_params=params)
            # The scheduler's own span, arrival to the last finish (what the simulator predicts),
            # without the call's round trip through the engine's processes.
            times.append(max(r["meta_info"]["e2e_latency"] for r in results))
        out.append(Run(*shape, min(times[1:])))
    return out


def recorded_forwards(
    config: ModelConfig, trace: list[TraceRequest], max_total_tokens: int, **server_args: Any
) -> list[ForwardRecord]:
    """The forwards the real scheduler runs for a trace that all arrives at t=0."""
    # With the reads a cascade shares: the fit decides whether the engine's attention has one.
    result = simulate(config, None, trace, max_total_tokens, count_shared_reads=True, **server_args)
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
    cascade: bool = False,
) -> HardwareProfile:
    """The grid point with the least squared log error; forwards: per run, each forward's work;
    cascade: whether the engine's attention reads a shared prefix once per batch."""
    measured = np.log(np.array([r.seconds for r in runs]))
    # One row per forward, and the run it belongs to.
    linear = np.array([w.linear_flops for run in forwards for w in run]) / peak_flops
    attention = np.array([w.attention_flops for run in forwards for w in run]) / peak_flops
    moved = np.array([w.bytes - w.shared_bytes * cascade for run in forwards for w in run]) / bandwidth
    owner = np.repeat(np.arange(len(forwards)), [len(run) for run in forwards])
    decodes = np.array([sum(w.decode for w in run) for run in forwards], dtype=float)
    prefills = np.array([len(run) for run in forwards], dtype=float) - decodes
    rows = np.array([sum(w.rows for w in run) for run in forwards], dtype=float)
    overhead = FORWARD_OVERHEAD_S
    # Every (prefill overhead, decode overhead, row overhead) triple at once:
    # [runs, prefill overheads, decode overheads, row overheads].
    fixed = (
        prefills[:, None, None, None] * overhead[None, :, None, None]
        + decodes[:, None, None, None] * overhead[None, None, :, None]
        + rows[:, None, None, None] * ROW_OVERHEAD_S[None, None, None, :]
    )
    best: tuple[float, HardwareProfile] | None = None
    for ef, ea, eb in itertools.product(FLOPS_EFFICIENCY, ATTENTION_EFFICIENCY, BANDWIDTH_EFFICIENCY):
        per_forward = np.maximum(linear / ef + attention / ea, moved / eb)
        roof = np.bincount(owner, weights=per_forward, minlength=len(forwards))
        predicted = roof[:, None, None, None] + fixed
        error = ((np.log(predicted) - measured[:, None, None, None]) ** 2).mean(axis=0)
        i, j, k = np.unravel_index(int(np.argmin(error)), error.shape)
        if best is None or error[i, j, k] < best[0]:
            profile = HardwareProfile(
                name,
                peak_flops,
                bandwidth,
                memory_bytes,
                float(ef),
                float(eb),
                float(overhead[i]),
                token_overhead_s=0.0,  # per row instead (ROW_OVERHEAD_S)
                note="fitted by radixserve calibrate",
                attention_efficiency=float(ea),
                decode_overhead_s=float(overhead[j]),
                cascade_attention=cascade,
                row_overhead_s=float(ROW_OVERHEAD_S[k]),
            )
            best = (float(error[i, j, k]), profile)
    assert best is not None
    return best[1]


def forward_costs(config: ModelConfig, records: list[ForwardRecord]) -> list[ForwardWork]:
    shape = ModelShape.of(config)
    return [forward_work(shape, r.shape) for r in records]
