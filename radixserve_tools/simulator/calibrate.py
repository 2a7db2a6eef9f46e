"""`radixserve calibrate`: a hardware profile of this machine, fitted so that the simulator predicts
measured runs (benchmarks/simulator_validation.py then measures its error on workloads the fit
did not use).

1. Peaks, measured here on the matmul the engine's linears run (simulator/peaks.py): its FLOP/s,
   overall and by model width; a stack of its linears by rows, which gives the rate it streams
   weights (taken as the weights' bandwidth, not fitted) and how a decode step's compute and
   memory combine (its norm, not fitted either); and what a value costs in the engine's norms,
   rotary embedding and activation. Beside them, the engine's scheduler's own time per decode
   row (the row cost, held).
2. Calibration runs (simulator/calibration_passes.py): prefill-heavy, decode-heavy and
   long-context batches (some over prefixes cached beforehand) through a real Engine, timed, and
   one of them again after the engine idled.
3. The fit: the scheduler's batching of a batch that all arrives at once does not depend on time,
   so each run's forwards are recorded once (the zero-cost executor) and the profile's
   efficiencies and overheads are searched (a grid, a pattern search, then scipy's least squares)
   for the least squared log error of sum(forward times) against the measured times, for each
   causal-mask block (and each way compute and memory may combine, where the stack was not
   measured: a profile saved before it was). Where calibrate timed a prompt's attention by its
   length (the engine's own backend: peaks.measure_prompt_attention), that prices each request's
   new tokens among themselves, and the fit neither picks a block nor fits their efficiency. Where
   it timed an extend over a cached prefix by its pairs (peaks.measure_extend_attention), that
   prices such an extend's whole attention, and the fit leaves the context's efficiency unset.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.optimize import least_squares

from radixserve.models.config import ModelConfig
from radixserve_tools.simulator.calibration_passes import (
    WAKE_IDLE_S,
    CalibrationShape,
    Run,
    calibration_batch,
)
from radixserve_tools.simulator.cost_model import (
    ForwardWork,
    ModelShape,
    forward_seconds,
    forward_work,
    pointwise_seconds,
    wake_seconds,
    wake_share,
)
from radixserve_tools.simulator.executor import SIM_VOCAB, ForwardRecord
from radixserve_tools.simulator.hardware import HardwareProfile
from radixserve_tools.simulator.peaks import fit_overlap
from radixserve_tools.simulator.simulate import simulate
from radixserve_tools.simulator.trace import TraceRequest

FLOPS_EFFICIENCY = np.geomspace(0.05, 2.0, 24)
# Attention (softmax, small per-head matmuls) may run far below the linears' efficiency.
ATTENTION_EFFICIENCY = np.geomspace(0.005, 2.0, 20)
# Up to 64 ms: on a GPU a small model's forward can be bound by the host (launches, Python).
FORWARD_OVERHEAD_S = np.concatenate([[0.0], np.geomspace(0.1e-3, 64e-3, 19)])
# Per row that samples (a request's next token). Fitted per row, not per new token: the host's
# per-request work is the same for a prefill's hundreds of tokens as for a decode step's one.
ROW_OVERHEAD_S = np.array([0.0, 10e-6, 25e-6, 50e-6, 100e-6, 200e-6, 400e-6])


# When the timed batch arrives in a recorded run (plus the shape's idle): after its cached
# prefix's request has finished, which with a zero-cost executor is at 0. A millisecond, so that
# the records' idle_s is the run's as calibrate times it: right after the prefix's request.
_TIMED_ARRIVAL_S = 1e-3


def recorded_forwards(
    config: ModelConfig, shape: CalibrationShape, seed: int, max_total_tokens: int, **server_args: Any
) -> list[ForwardRecord]:
    """The forwards the real scheduler runs for a calibration shape's timed batch (arriving all at
    once, after its cached prefixes' requests, whose forwards are left out as their time is)."""
    batch = calibration_batch(shape, SIM_VOCAB, seed)
    trace = [TraceRequest(0.0, prefix, 1) for prefix in batch.prefixes]
    trace += [TraceRequest(_TIMED_ARRIVAL_S + shape.idle_s, p, shape.output_len) for p in batch.prompts]
    # With the reads a cascade shares: the fit decides whether the engine's attention has one.
    result = simulate(config, None, trace, max_total_tokens, count_shared_reads=True, **server_args)
    assert result.requests == len(trace)
    return [r for r in result.records if r.start >= _TIMED_ARRIVAL_S]


@dataclass(frozen=True)
class _Forwards:
    """Every calibration run's forwards as arrays, one entry per forward: its linears' seconds at
    100% of their rate at the model's width (HardwareProfile.linear_peak), its attention's at 100%
    of the peak FLOP/s, its bytes' seconds at the measured bandwidth (the rate the engine's linear
    streams weights: peaks.py, taken as it is, not fitted), whether it is a decode step, its
    sampling rows, and the run it belongs to. Attention in the
    parts the cost model splits it into: among the new tokens, over the cached context, and (with
    a cascade) over prefixes the batch shares, with those prefixes' keys.

    A forward's compute is linear in the parameters' reciprocal efficiencies (and the cost per
    shared key), and its fixed costs in the fixed parameters: `compute_terms` and `fixed_terms`
    hold the coefficients, so that one product prices a batch of parameter vectors at once (the
    fit's searches try several at every step)."""

    linear: np.ndarray
    measured: np.ndarray  # seconds at measured costs (not fitted): pointwise ops, measured attention
    attention: np.ndarray
    context: np.ndarray  # over a cached context, less the part over shared prefixes
    shared: np.ndarray  # over prefixes the batch shares (a cascade's; 0 without one)
    moved: np.ndarray
    decode: np.ndarray
    rows: np.ndarray
    owner: np.ndarray
    runs: int
    norm: float | None  # HardwareProfile.memory_compute_norm
    # [forwards, 8]: the seconds at 100% of a prefill's linears, a decode step's linears, the
    # measured costs, the new tokens' attention, the shared prefixes', a prefill's context's, a
    # decode step's context's, and the K/V tokens (per layer) a cascade's calls read (0 without
    # one; see _compute_coefficients).
    compute_terms: np.ndarray
    # [forwards, 3]: whether a prefill, whether a decode step, and the sampled rows (their costs:
    # _PARAMETERS' prefill_fixed, decode_fixed and row).
    fixed_terms: np.ndarray
    # [runs, forwards]: which run each forward belongs to.
    membership: np.ndarray

    @classmethod
    def of(
        cls,
        forwards: list[list[ForwardWork]],
        peaks: HardwareProfile,
        linear_peak: float,
        cascade: bool,
        norm: float | None,
    ) -> _Forwards:
        every = [w for run in forwards for w in run]
        peak_flops, bandwidth = peaks.peak_flops, peaks.memory_bandwidth
        shared = np.array([w.shared_context_flops * cascade for w in every]) / peak_flops
        linear = np.array([w.linear_flops for w in every]) / linear_peak
        measured = np.array([pointwise_seconds(w, peaks.pointwise) + w.causal_attention_s for w in every])
        attention = np.array([w.attention_flops for w in every]) / peak_flops
        context = np.array([w.context_attention_flops for w in every]) / peak_flops - shared
        shared_keys = np.array([w.shared_prefix_keys * cascade for w in every])
        decode = np.array([w.decode for w in every], dtype=bool)
        rows = np.array([w.rows for w in every], dtype=float)
        owner = np.repeat(np.arange(len(forwards)), [len(run) for run in forwards])
        prefill = ~decode
        return cls(
            linear,
            measured,
            attention,
            context,
            shared,
            np.array([w.bytes - w.shared_bytes * cascade for w in every]) / bandwidth,
            decode,
            rows,
            owner,
            len(forwards),
            norm,
            np.stack(
                [linear * prefill, linear * decode, measured, attention, shared]
                + [context * prefill, context * decode, shared_keys],
                axis=1,
            ),
            np.stack([prefill, decode, rows], axis=1).astype(float),
            (owner[None, :] == np.arange(len(forwards))[:, None]).astype(float),
        )

    def roofline(self, compute: np.ndarray) -> np.ndarray:
        """Each forward's time before its fixed costs, for its `compute` seconds ([forwards] or
        [forwards, candidates]): HardwareProfile.roofline over arrays (the fit evaluates it
        thousands of times)."""
        moved = self.moved if compute.ndim == 1 else self.moved[:, None]
        larger: np.ndarray = np.maximum(compute, moved)
        if self.norm is None:
            return larger
        normed = (compute**self.norm + moved**self.norm) ** (1 / self.norm)
        return np.where(self.decode if compute.ndim == 1 else self.decode[:, None], normed, larger)

    def run_seconds(self, p: np.ndarray) -> np.ndarray:
        """Each run's predicted seconds for the parameters `p` (as in _PARAMETERS): [runs] for one
        vector, [runs, candidates] for a stack of them ([candidates, parameters])."""
        stack = np.atleast_2d(p)
        compute = self.compute_terms @ _compute_coefficients(stack)
        fixed = self.fixed_terms @ stack[:, _EFFICIENCIES : _EFFICIENCIES + 3].T
        per_forward = self.roofline(compute) + fixed
        seconds: np.ndarray = self.membership @ per_forward
        return seconds[:, 0] if p.ndim == 1 else seconds


def _compute_coefficients(p: np.ndarray) -> np.ndarray:
    """[8, candidates]: what multiplies each of _Forwards.compute_terms' columns, for a stack of
    parameter vectors ([candidates, parameters])."""
    flops, attention, decode_flops, context, decode_attention, shared = p[:, :_EFFICIENCIES].T
    inverse = [1 / flops, 1 / decode_flops, np.ones(len(p)), 1 / attention, 1 / shared]
    return np.stack([*inverse, 1 / context, 1 / decode_attention, p[:, -1]])


# The fitted parameters, in order: efficiencies (searched by ratios) then fixed costs in seconds
# (searched by steps).
_PARAMETERS = (
    "flops", "attention", "decode_flops", "context", "decode_attention", "shared",
    "prefill_fixed", "decode_fixed", "row", "shared_key",
)  # fmt: skip
_EFFICIENCIES = 6
_ATTENTION = _PARAMETERS.index("attention")
_CONTEXT = _PARAMETERS.index("context")
_ROW = _PARAMETERS.index("row")
_EFFICIENCY_BOUNDS = (0.002, 4.0)
_FIXED_BOUNDS = (0.0, 0.25)


# How compute and memory times combine (HardwareProfile.memory_compute_norm), as the fit tries
# them where no stack of linears was measured (peaks.fit_overlap sets it otherwise): the
# roofline's larger of the two, partial overlaps, and their sum. On the 2-core Zen 3 one
# row through a 576-wide model's linears took 8.2 ms, 16 rows 27 ms, at 1.4 ms of compute per row:
# between the larger (22 ms) and the sum (31 ms), near the 1.5-norm's 26 ms.
MEMORY_COMPUTE_NORMS: tuple[float | None, ...] = (None, 3.0, 2.0, 1.5, 1.0)


# The causal mask's granularities (HardwareProfile.attention_block) the fit tries where calibrate
# did not measure a prompt's attention: exact (a GPU kernel's tiles are small next to most
# prompts), and blocks of 128 and 512 keys (torch's CPU flash kernel).
ATTENTION_BLOCKS = (1, 128, 512)


def fit(
    config: ModelConfig,
    runs: list[Run],
    records: list[list[ForwardRecord]],
    peaks: HardwareProfile,
    cascade: bool = False,
    row_overhead_s: float | None = None,
) -> HardwareProfile:
    """The profile with the least squared log error of each run's predicted against measured
    seconds; records: per run, its forwards (recorded_forwards); cascade: whether the engine's
    attention reads a shared prefix once per batch. Each of ATTENTION_BLOCKS is fitted in turn,
    each with the norm `peaks.decode_overlap` shows (peaks.fit_overlap) or, where calibrate did not
    measure it, with each of MEMORY_COMPUTE_NORMS; the best is kept. A run after an idle spell is left
    out of that fit: it sets idle_wake_s.

    `row_overhead_s`: the host's cost per sampled row as the engine measured it (its scheduler's
    HostTimeLine), held there; None fits it with the rest. The runs of one model cannot split a
    decode step's cost per row between the host and the model's compute, so a fitted row cost
    takes up the compute's error too (docs/simulator.md).

    `peaks`: what calibrate measured (simulator/peaks.py), taken as it is; the fit fills in the
    rest. Its name, memory size, peak FLOP/s and the linears' FLOP/s by model width (the linears'
    efficiencies are fitted as shares of the rate at this model's width); the weights' bandwidth,
    which is not fitted: a decode step reads the same weights at every batch size, so the runs
    show only the sum of their reading and the step's fixed cost (docs/simulator.md), and the
    measured rate splits it; the pointwise ops' costs, which the runs of one model cannot tell
    from its linears' efficiency; how a decode step's compute and memory combine; and a prompt's
    attention by its length and an extend's by its pairs, where measured (their calls' own cost,
    which the runs would otherwise leave to the linears' efficiency and the fixed costs; and an
    extend's masked call computes its causal half in full: docs/simulator.md)."""
    linear_peak = peaks.linear_peak(config.hidden_size)
    # Measured where calibrate timed the overlap: one model's runs tell the norms apart poorly,
    # and the one they pick misprices a wider model's decode steps (docs/simulator.md).
    norms = (fit_overlap(peaks.decode_overlap).norm,) if peaks.decode_overlap else MEMORY_COMPUTE_NORMS
    back_to_back = [i for i, run in enumerate(runs) if not run.shape.idle_s]
    measured = np.log(np.array([runs[i].seconds for i in back_to_back]))
    # Where a prompt's attention was measured, it prices the new tokens among themselves: no block
    # to pick, and no efficiency of theirs to fit. Where an extend's was, it prices every extend
    # over a cached prefix that no cascade attends: no efficiency over a cached context to fit.
    prompt = peaks.prompt_attention_s if peaks.prompt_attention else None
    extend = peaks.extend_attention_s if peaks.extend_attention else None
    blocks = ATTENTION_BLOCKS if prompt is None else (1,)
    best: tuple[float, int, float | None, np.ndarray] | None = None
    for block in blocks:
        forwards = [forward_costs(config, records[i], block, prompt, extend, cascade) for i in back_to_back]
        for norm in norms:
            data = _Forwards.of(forwards, peaks, linear_peak, cascade, norm)
            p, error = _fit_parameters(data, measured, row_overhead_s)
            if best is None or error < best[0]:
                best = (error, block, norm, p)
    assert best is not None
    _, block, norm, p = best
    # The fixed costs' additive steps leave rounding residue (1e-20 s for a cost the search took
    # to 0): to the nanosecond (a shared key's, to the picosecond).
    p[_EFFICIENCIES:-1] = np.round(p[_EFFICIENCIES:-1], 9)
    p[-1] = np.round(p[-1], 12)
    flops, attention, decode_flops, context, decode_attention, shared = (float(x) for x in p[:_EFFICIENCIES])
    prefill_fixed, decode_fixed, row, shared_key = (float(x) for x in p[_EFFICIENCIES:])
    profile = dataclasses.replace(
        peaks,
        flops_efficiency=flops,
        bandwidth_efficiency=1.0,  # the bandwidth as measured
        forward_overhead_s=prefill_fixed,
        token_overhead_s=0.0,  # per row instead
        note="fitted by radixserve calibrate",
        attention_efficiency=attention if prompt is None else None,
        decode_overhead_s=decode_fixed,
        cascade_attention=cascade,
        row_overhead_s=row,
        decode_flops_efficiency=decode_flops,
        context_attention_efficiency=context if extend is None else None,
        decode_attention_efficiency=decode_attention,
        # Without a cascade no forward showed it: left to default to the context's.
        shared_prefix_attention_efficiency=shared if cascade else None,
        shared_prefix_key_s=shared_key,
        attention_block=block,
        memory_compute_norm=norm,
        idle_wake_after_s=WAKE_IDLE_S,
    )
    wake = _idle_wake(config, profile, runs, records)
    return dataclasses.replace(profile, idle_wake_s=wake, forward_noise=forward_noise(runs))


def forward_noise(runs: list[Run]) -> float:
    """How much one forward's time varies (HardwareProfile.forward_noise): the pooled standard
    deviation of the log of each single-forward run's repeats within a pass (one request's prefill
    and its one output token, no idle before it). Within a pass, since the host drifts between
    passes; single forwards, since a run of many averages their spread out. 0 where none repeat."""
    single = [r for r in runs if r.shape.requests == 1 and r.shape.output_len == 1 and not r.shape.idle_s]
    df = sum(r.log_df for r in single)
    return math.sqrt(sum(r.log_squares for r in single) / df) if df else 0.0


def predicted_seconds(
    config: ModelConfig, profile: HardwareProfile, shape: CalibrationShape, forwards: list[ForwardRecord]
) -> float:
    """A calibration run's time as `profile` predicts it: its forwards, the first after its idle."""
    model = ModelShape.of(config)
    work = sum(forward_seconds(model, profile, f.shape) for f in forwards)
    return work + wake_seconds(profile, shape.idle_s)


def _idle_wake(
    config: ModelConfig, profile: HardwareProfile, runs: list[Run], records: list[list[ForwardRecord]]
) -> float:
    """What a forward after an idle spell costs more: the runs timed after one, less what the
    profile fitted on the rest predicts of their forwards (the same shape as a run timed right
    after another), per their idle's share of WAKE_IDLE_S. The median, and never below 0."""
    extra = [
        (run.seconds - predicted_seconds(config, profile, run.shape, forwards))
        / wake_share(profile, run.shape.idle_s)
        for run, forwards in zip(runs, records, strict=True)
        if run.shape.idle_s
    ]
    return max(0.0, round(statistics.median(extra), 9)) if extra else 0.0


def _fit_parameters(
    data: _Forwards, measured: np.ndarray, row_overhead_s: float | None = None
) -> tuple[np.ndarray, float]:
    """The parameters (as in _PARAMETERS) with the least squared log error, and that error. A
    coarse grid finds the basin, then a pattern search refines every parameter: the grid's steps
    (17% between efficiencies) alone would leave errors of the size of the 9% target. Last, a
    least-squares solver (scipy's) moves all parameters at once: with ten of them, some trade against
    each other (a decode step's fixed cost against its attention), and one-at-a-time moves stall
    in such valleys short of the best fit. The row cost stays at `row_overhead_s` if given."""

    def residuals(p: np.ndarray) -> np.ndarray:
        """[runs] for one parameter vector, [runs, candidates] for a stack of them."""
        seconds = data.run_seconds(p)
        return np.asarray(np.log(seconds) - (measured if p.ndim == 1 else measured[:, None]))

    def error(p: np.ndarray) -> np.ndarray:
        """The mean squared residual: a 0-d array for one vector, one per candidate for a stack."""
        return np.asarray((residuals(p) ** 2).mean(axis=0))

    free = np.ones(len(_PARAMETERS), dtype=bool)
    free[_ATTENTION] = data.attention.any()  # none where a prompt's attention was measured
    free[_CONTEXT] = data.context.any()  # none where an extend's was
    rows = ROW_OVERHEAD_S
    if row_overhead_s is not None:
        free[_ROW], rows = False, np.array([row_overhead_s])
    p = _least_squares(residuals, _polish(error, _coarse_grid(data, measured, rows), free), free)
    return p, float(error(p))


def _coarse_grid(data: _Forwards, measured: np.ndarray, row_costs: np.ndarray) -> np.ndarray:
    """The best point of the grids above (with `row_costs` for the row cost), a decode step's
    linears at the prefill's efficiency and attention over the cached context (shared or not) at
    the causal attention's."""
    decodes = np.bincount(data.owner, weights=data.decode, minlength=data.runs)
    prefills = np.bincount(data.owner, minlength=data.runs) - decodes
    rows = np.bincount(data.owner, weights=data.rows, minlength=data.runs)
    overhead = FORWARD_OVERHEAD_S
    # Every (prefill overhead, decode overhead, row overhead) triple at once:
    # [runs, prefill overheads, decode overheads, row overheads].
    fixed = (
        prefills[:, None, None, None] * overhead[None, :, None, None]
        + decodes[:, None, None, None] * overhead[None, None, :, None]
        + rows[:, None, None, None] * row_costs[None, None, None, :]
    )
    best: tuple[float, np.ndarray] | None = None
    attention = data.attention + data.context + data.shared
    for ef, ea in itertools.product(FLOPS_EFFICIENCY, ATTENTION_EFFICIENCY):
        per_forward = data.roofline(data.linear / ef + data.measured + attention / ea)
        roof = np.bincount(data.owner, weights=per_forward, minlength=data.runs)
        predicted = roof[:, None, None, None] + fixed
        error = ((np.log(predicted) - measured[:, None, None, None]) ** 2).mean(axis=0)
        i, j, k = np.unravel_index(int(np.argmin(error)), error.shape)
        if best is None or error[i, j, k] < best[0]:
            costs = [overhead[i], overhead[j], row_costs[k], 0.0]
            point = np.array([ef, ea, ef, ea, ea, ea, *costs])
            best = (float(error[i, j, k]), point)
    assert best is not None
    return best[1]


def _polish(error: Any, start: np.ndarray, free: np.ndarray, rounds: int = 200) -> np.ndarray:
    """A pattern search from `start`: each `free` parameter in turn moves up or down by its step
    while that lowers the error; when none does, the steps halve. Efficiencies move by ratios,
    fixed costs by steps of seconds; both stay within their bounds."""
    p, best = start.copy(), float(error(start))
    ratio = np.full(_EFFICIENCIES, 0.16)  # log-steps, about the coarse grid's
    step = np.maximum(start[_EFFICIENCIES:] * 0.4, [200e-6, 200e-6, 20e-6, 50e-9])
    signs = np.array([1.0, -1.0])
    for _ in range(rounds):
        moved = False
        for i in np.flatnonzero(free):
            # Up and down from the same point, priced together; up is taken where both lower it.
            q = np.repeat(p[None, :], 2, axis=0)
            if i < _EFFICIENCIES:
                q[:, i] = np.clip(p[i] * np.exp(signs * ratio[i]), *_EFFICIENCY_BOUNDS)
            else:
                q[:, i] = np.clip(p[i] + signs * step[i - _EFFICIENCIES], *_FIXED_BOUNDS)
            errors = error(q)
            for candidate, e in zip(q, errors, strict=True):
                if e < best:
                    p, best, moved = candidate, float(e), True
                    break
        if not moved:
            ratio, step = ratio / 2, step / 2
            if ratio[0] < 1e-3:  # ratios within 0.1%
                break
    return p


# The scale of each fixed cost in the least-squares coordinates (efficiencies move by their
# logarithms): about the size a fit gives them, so that every coordinate moves by steps near 1.
_FIXED_SCALES = np.array([1e-3, 1e-3, 1e-5, 1e-7])


def _least_squares(residuals: Any, start: np.ndarray, free: np.ndarray) -> np.ndarray:
    """Least squares of residuals(p) from `start` over the `free` parameters, within their bounds:
    scipy's trust-region reflective method, in coordinates where efficiencies move by their
    logarithms and fixed costs by their scales."""

    def params(x: np.ndarray) -> np.ndarray:
        efficiencies, fixed = np.exp(x[:_EFFICIENCIES]), x[_EFFICIENCIES:] * _FIXED_SCALES
        return np.concatenate([efficiencies, fixed])

    efficiencies = np.log(_EFFICIENCY_BOUNDS)
    lo = np.concatenate([np.full(_EFFICIENCIES, efficiencies[0]), _FIXED_BOUNDS[0] / _FIXED_SCALES])
    hi = np.concatenate([np.full(_EFFICIENCIES, efficiencies[1]), _FIXED_BOUNDS[1] / _FIXED_SCALES])
    x = np.concatenate([np.log(start[:_EFFICIENCIES]), start[_EFFICIENCIES:] / _FIXED_SCALES])
    moving = np.flatnonzero(free)

    def moved(values: np.ndarray) -> np.ndarray:
        point = x.copy()
        point[moving] = values
        return np.asarray(residuals(params(point)))

    fit = least_squares(moved, np.clip(x[moving], lo[moving], hi[moving]), bounds=(lo[moving], hi[moving]))
    x[moving] = fit.x
    return params(x)


def forward_costs(
    config: ModelConfig,
    records: list[ForwardRecord],
    attention_block: int = 1,
    prompt_attention: Callable[[int], float] | None = None,
    extend_attention: Callable[[int], float] | None = None,
    cascade: bool = False,
) -> list[ForwardWork]:
    """Each record's work (cost_model.forward_work, with the same arguments)."""
    shape = ModelShape.of(config)
    return [
        forward_work(shape, r.shape, attention_block, prompt_attention, extend_attention, cascade)
        for r in records
    ]
