"""This machine's peaks for the roofline, all on the matmul the engine's linears run (the kernel the
model runner picks for the same flags, not torch's: torch's bf16 matmul is emulated on a CPU
without AVX-512 BF16): a square product's FLOP/s, the rate one row streams a large weight, and the
FLOP/s of a model's linears at each of several hidden sizes. Beside them, what a value costs in
the engine's pointwise ops (norms, rotary embedding, activation)."""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from radixserve.attention.base import AttentionBackend, AttentionSpec, LayerInputs
from radixserve.attention.registry import choose_attention_backend
from radixserve.config.server_args import ServerArgs
from radixserve.executor.model_runner import pick_dtype
from radixserve.forward.batch import ExtendSegment, ForwardMode
from radixserve.kernels.cpu_ops import CpuKernels, select_cpu_kernels
from radixserve.layers.activation import silu_and_mul
from radixserve.layers.norm import RMSNorm
from radixserve.layers.packed_weights import WeightPacking, cpu_packing_supported
from radixserve.layers.rotary import RotaryEmbedding
from radixserve.models.config import ModelConfig
from radixserve_tools.simulator.hardware import HardwareProfile, PointwiseCosts


def measure_flops(
    device: torch.device | None = None,
    seconds: float = 1.0,
    dtype: torch.dtype = torch.bfloat16,
    packing: WeightPacking | None = None,
) -> float:
    """The matmul FLOP/s of the engine's linears on `device` (default: this machine's CPU
    threads), a square product large enough to fill it: with `packing` (a CPU's bf16 weights
    packed for its kernel: engine_linears) that kernel's, else torch's in `dtype`."""
    device = device or torch.device("cpu")
    n = 8192 if device.type == "cuda" else 1024
    square = _engine_linear(torch.randn(n, n, dtype=dtype, device=device), packing)
    a = torch.randn(n, n, dtype=dtype, device=device)
    return _rate(lambda: square(a), 2 * n**3, seconds, device)


# The stack measure_decode_overlap times: (hidden size, intermediate size, layers), each layer's
# attention projections and MLP as four linears, 256 MiB in bf16, more than any CPU's or GPU's
# cache holds, so that each row reads it from memory. A wide model's shapes: a narrow one's small
# matrices add per-call costs beside the overlap it measures.
OVERLAP_STACK = (2048, 8192, 2)
# The rows it is timed with: one (the weights' reading alone), through rows whose compute matches
# that reading, to rows whose compute dominates.
OVERLAP_ROWS = (1, 2, 4, 8, 16, 32, 64)


def measure_decode_overlap(
    device: torch.device | None = None,
    seconds: float = 4.0,
    dtype: torch.dtype = torch.bfloat16,
    packing: WeightPacking | None = None,
) -> tuple[tuple[int, float], ...]:
    """(rows, seconds) for OVERLAP_ROWS through OVERLAP_STACK on the engine's linears
    (HardwareProfile.decode_overlap): the median time of each, `seconds` spent in all."""
    device = device or torch.device("cpu")
    hidden, intermediate, layers = OVERLAP_STACK
    shapes = [(3 * hidden, hidden), (hidden, hidden), (2 * intermediate, hidden), (hidden, intermediate)]
    stack = [
        _engine_linear(torch.randn(out, into, dtype=dtype, device=device) / into**0.5, packing)
        for _ in range(layers)
        for out, into in shapes
    ]

    def forward(x: torch.Tensor, wide: torch.Tensor) -> None:
        for i in range(0, len(stack), len(shapes)):
            qkv, o, gate_up, down = stack[i : i + len(shapes)]
            qkv(x)
            o(x)
            gate_up(x)
            down(wide)

    calls = [
        functools.partial(
            forward,
            torch.randn(rows, hidden, dtype=dtype, device=device),
            torch.randn(rows, intermediate, dtype=dtype, device=device),
        )
        for rows in OVERLAP_ROWS
    ]
    # Every row count in turn, round after round, each the median of its rounds: a slow spell of
    # the host then slows one round of all of them, not every sample of one (as calibration
    # passes are taken: calibration_passes.py).
    for call in calls:  # untimed: first calls pay one-off setup
        _seconds(call, device)
    times: list[list[float]] = [[] for _ in calls]
    start = time.perf_counter()
    while not times[0] or time.perf_counter() - start < seconds:
        for call, samples in zip(calls, times, strict=True):
            samples.append(_seconds(call, device))
    return tuple((rows, statistics.median(t)) for rows, t in zip(OVERLAP_ROWS, times, strict=True))


def overlap_stack_bytes(dtype: torch.dtype) -> int:
    """The bytes of OVERLAP_STACK's weights in `dtype`."""
    hidden, intermediate, layers = OVERLAP_STACK
    values = layers * (4 * hidden * hidden + 3 * hidden * intermediate)
    return values * torch.finfo(dtype).bits // 8


# The norms a measured overlap picks from (HardwareProfile.memory_compute_norm): 1 (the sum) to 4
# in steps of 0.1, and None (the larger of the two).
OVERLAP_NORMS: tuple[float | None, ...] = (*(round(1 + 0.1 * k, 1) for k in range(31)), None)


@dataclass(frozen=True)
class OverlapFit:
    """How a stack of linears' time by rows (measure_decode_overlap) splits: the norm its compute
    and memory combine by, the weights' reading and the compute per row."""

    norm: float | None
    memory_s: float
    per_row_s: float


def fit_overlap(
    overlap: Sequence[tuple[int, float]], norms: Sequence[float | None] = OVERLAP_NORMS
) -> OverlapFit:
    """The one of `norms` that best draws the stack's time by rows. For each norm, the weights'
    reading and the compute per row that give the fewest rows' and the most rows' times exactly
    under it; then its squared log error over the rows between; the least wins."""
    (one, single), *between, (most, longest) = overlap

    def parts(p: float | None) -> OverlapFit:
        if p is None:  # the larger of the two: one row is all reading, the most rows all compute
            return OverlapFit(p, single, longest / most)
        # t(rows) = ((rows * per_row)^p + memory^p)^(1/p) at both ends.
        per_row = max((longest**p - single**p) / (most**p - one**p), 0.0) ** (1 / p)
        return OverlapFit(p, max(single**p - (one * per_row) ** p, 0.0) ** (1 / p), per_row)

    def error(fitted: OverlapFit) -> float:
        device = HardwareProfile("overlap", 1.0, 1.0, 0.0, memory_compute_norm=fitted.norm)
        return sum(
            math.log(device.roofline(rows * fitted.per_row_s, fitted.memory_s, decode=True) / t) ** 2
            for rows, t in between
        )

    return min((parts(p) for p in norms), key=error)


def weights_bandwidth(overlap: Sequence[tuple[int, float]], dtype: torch.dtype) -> float:
    """The rate the engine's linears stream weights (HardwareProfile.memory_bandwidth): the
    stack's bytes over its reading, as fit_overlap splits one row's time. A decode step's time is
    that reading plus its fixed cost, the same at every batch size, so runs of one model cannot
    tell them apart (docs/simulator.md): the fit takes this rate as the weights' and fits only the
    rest. Taken in the same rounds as the rows that set the norm, so that the host's drift between
    two measurements cannot set the two apart."""
    return overlap_stack_bytes(dtype) / fit_overlap(overlap).memory_s


def median_measurements(samples: Sequence[HardwareProfile], dtype: torch.dtype) -> HardwareProfile:
    """What calibrate measured of this device, taken several times between its timed passes (`dtype`:
    the engine's linears'): each figure and each entry of each table the median of its samples, the
    weights' bandwidth that of the median stack (weights_bandwidth). The host's speed drifts within
    minutes, by more than the 9% target (docs/simulator.md): measured once, the peaks were one
    moment's while the passes' medians spanned the whole calibration, and the fitted efficiencies
    took up the difference."""
    if not samples:
        raise ValueError("no measurement of the peaks to take the median of")
    first = samples[0]
    overlap = _median_table([s.decode_overlap for s in samples])
    bandwidth = statistics.median(s.memory_bandwidth for s in samples)
    if overlap:
        bandwidth = weights_bandwidth(overlap, dtype)
    pointwise = {
        field.name: statistics.median(getattr(s.pointwise, field.name) for s in samples)
        for field in fields(PointwiseCosts)
    }
    return HardwareProfile(
        first.name,
        statistics.median(s.peak_flops for s in samples),
        bandwidth,
        first.memory_bytes,
        linear_rates=_median_table([s.linear_rates for s in samples]),
        pointwise=PointwiseCosts(**pointwise),
        decode_overlap=overlap,
        prompt_attention=_median_table([s.prompt_attention for s in samples]),
        extend_attention=_median_table([s.extend_attention for s in samples]),
    )


def _median_table(tables: Sequence[tuple[tuple[int, float], ...]]) -> tuple[tuple[int, float], ...]:
    """The median of each entry of tables measured at the same sizes."""
    sizes = [size for size, _ in tables[0]]
    if any([size for size, _ in table] != sizes for table in tables):
        raise ValueError("the measurements' tables are not of the same sizes")
    return tuple((size, statistics.median(table[i][1] for table in tables)) for i, size in enumerate(sizes))


# The hidden sizes measure_linear_rates times: SmolLM2-135M's is 576, Llama-3.2-1B's 2048, an
# 8B's 4096.
LINEAR_WIDTHS = (512, 1024, 2048, 4096)


def linear_widths(config: ModelConfig) -> tuple[int, ...]:
    """The widths calibrate times for a calibration model of `config`: LINEAR_WIDTHS and its own.
    A rate read between two measured widths can be far from the rate there: on a 2-core Zen 4 the
    576-wide pair ran at 341 GFLOP/s, between 422 at 512 and 348 at 1,024, until a kernel fix
    (docs/simulator.md), and the fitted efficiencies are shares of the rate at this width."""
    return tuple(sorted({*LINEAR_WIDTHS, config.hidden_size}))


def measure_linear_rates(
    device: torch.device | None = None,
    seconds: float = 4.0,
    dtype: torch.dtype = torch.bfloat16,
    packing: WeightPacking | None = None,
    widths: tuple[int, ...] = LINEAR_WIDTHS,
) -> tuple[tuple[int, float], ...]:
    """The FLOP/s of the engine's linears in a model of each hidden size (HardwareProfile.
    linear_rates): a prompt's tokens through an MLP's pair, up to four times the width and down
    again, `seconds` spent in all."""
    device = device or torch.device("cpu")
    tokens = 2048 if device.type == "cuda" else 256
    out = []
    for width in widths:
        weight = torch.randn(4 * width, width, dtype=dtype, device=device) / width**0.5
        up, down = _engine_linear(weight, packing), _engine_linear(weight.t().contiguous(), packing)
        x = torch.randn(tokens, width, dtype=dtype, device=device)
        flops = 2 * 2 * tokens * width * 4 * width
        mlp = functools.partial(_through, x, up, down)
        out.append((width, _rate(mlp, flops, seconds / len(widths), device)))
    return tuple(out)


# The layer whose pointwise ops measure_pointwise times: a 1024-wide one (a value's cost hardly
# depends on the width: on a 2-core Zen 3 within a third between 576 and 2048 wide).
POINTWISE_LAYER = {"hidden": 1024, "intermediate": 4096, "heads": 16, "kv_heads": 4, "head_dim": 64}


def measure_pointwise(
    device: torch.device | None = None,
    seconds: float = 1.5,
    dtype: torch.dtype = torch.bfloat16,
    kernels: CpuKernels | None = None,
) -> PointwiseCosts:
    """Seconds per value and per call of a layer's pointwise ops (HardwareProfile.pointwise) on the
    engine's own layers: RMSNorm, the rotary embedding and SiLU-and-multiply, on `kernels` (the
    native CPU kernels the model runner picks: engine_kernels) where they run, through
    POINTWISE_LAYER; `seconds` spent in all. Each op is timed on one token and on a prompt's: the
    line through the two gives its cost per value (the slope) and per call (what is left of one
    token's time)."""
    device = device or torch.device("cpu")
    tokens = 2048 if device.type == "cuda" else 256
    layer = POINTWISE_LAYER
    hidden, heads = layer["hidden"], layer["heads"] + layer["kv_heads"]
    norm = RMSNorm(hidden, 1e-5, kernels).to(device=device, dtype=dtype)  # as the model holds it
    x = torch.randn(tokens, hidden, dtype=dtype, device=device)
    rope = RotaryEmbedding(layer["head_dim"], tokens, 10000.0, None).to(device)
    rotations = {n: rope.lookup(torch.arange(n, device=device), dtype, kernels) for n in (1, tokens)}
    qk = torch.randn(tokens, heads, layer["head_dim"], dtype=dtype, device=device)
    gate_up = torch.randn(tokens, 2 * layer["intermediate"], dtype=dtype, device=device)
    each = seconds / 3
    norm_s, norm_call_s = _per_value_and_call(lambda n: norm(x[:n]), hidden, tokens, each, device)
    rotary_s, rotary_call_s = _per_value_and_call(
        lambda n: rotations[n].rotate_(qk[:n]), heads * layer["head_dim"], tokens, each, device
    )
    activation_s, activation_call_s = _per_value_and_call(
        lambda n: silu_and_mul(gate_up[:n], kernels), layer["intermediate"], tokens, each, device
    )
    return PointwiseCosts(norm_s, rotary_s, activation_s, norm_call_s, rotary_call_s, activation_call_s)


def _per_value_and_call(
    op: Callable[[int], object], values_per_token: int, tokens: int, seconds: float, device: torch.device
) -> tuple[float, float]:
    """(seconds per value, seconds per call) of `op` on n tokens, from its median time on one token
    and on `tokens` (_rate), `seconds` spent on the two."""
    one = 1 / _rate(lambda: op(1), 1.0, seconds / 2, device)
    many = 1 / _rate(lambda: op(tokens), 1.0, seconds / 2, device)
    per_value = max(many - one, 0.0) / ((tokens - 1) * values_per_token)
    return per_value, max(one - values_per_token * per_value, 0.0)


# The layer measure_prompt_attention and measure_extend_attention time by default: POINTWISE_LAYER's
# query and K/V heads (their seconds are per query head and unit of head dim, which other layers'
# take in proportion; calibrate times the calibration model's own layer instead), and the prompt
# lengths: one token, short prompts whose call's own cost dominates, and long ones whose pairs do.
ATTENTION_LAYER = {name: POINTWISE_LAYER[name] for name in ("heads", "kv_heads", "head_dim")}
PROMPT_LENGTHS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048)


def measure_prompt_attention(
    backend: AttentionBackend, seconds: float = 3.0, lengths: Sequence[int] = PROMPT_LENGTHS
) -> tuple[tuple[int, float], ...]:
    """(new tokens, seconds) of `backend`'s attention over a prompt of each of `lengths` with no
    cached prefix, per query head and unit of head dim (HardwareProfile.prompt_attention): the
    median of each (_median_calls), `seconds` spent in all. `backend`: engine_attention's, the one
    the engine runs."""
    calls = [_extend_call(backend, tokens, 0) for tokens in lengths]
    return tuple(zip(lengths, _median_calls(calls, seconds, backend.spec), strict=True))


# The extends measure_extend_attention times, (new tokens, cached prefix): a follow-up turn's few
# tokens over a conversation, up to a long prompt's chunk over a long prefix. Their (query, key)
# pairs run from about a thousand to 1.3 million.
EXTEND_SHAPES = ((4, 256), (16, 512), (64, 512), (64, 2048), (256, 1024), (512, 2048))


def measure_extend_attention(
    backend: AttentionBackend, seconds: float = 3.0, shapes: Sequence[tuple[int, int]] = EXTEND_SHAPES
) -> tuple[tuple[int, float], ...]:
    """(pairs, seconds) of `backend`'s attention for one request's new tokens over a cached prefix
    of its own (no other request shares it: no cascade), for each (new tokens, prefix) of `shapes`:
    pairs = new tokens x (prefix + new tokens), every key the call reads for every query, and
    seconds per query head and unit of head dim (HardwareProfile.extend_attention), the median of
    each (_median_calls), `seconds` spent in all. On a CPU the engine runs such an extend as one
    masked call over all its keys, so its time follows those pairs, its causal half included."""
    calls = [_extend_call(backend, tokens, prefix) for tokens, prefix in shapes]
    pairs = [tokens * (prefix + tokens) for tokens, prefix in shapes]
    return tuple(sorted(zip(pairs, _median_calls(calls, seconds, backend.spec), strict=True)))


def _extend_call(backend: AttentionBackend, tokens: int, prefix: int) -> Callable[[], object]:
    """One layer's extend on `backend`: `tokens` new tokens over a cached prefix of `prefix`
    tokens, in a pool of the two alone (the new tokens' K/V already written, as the model's layers
    write them before attending)."""
    spec = backend.spec
    device, dtype = spec.device, spec.dtype
    q = torch.randn(tokens, spec.num_heads, spec.head_dim, dtype=dtype, device=device)
    k, v = (
        torch.randn(prefix + tokens, spec.num_kv_heads, spec.head_dim, dtype=dtype, device=device)
        for _ in range(2)
    )
    slots = torch.arange(prefix + tokens, device=device)
    segment = ExtendSegment(0, tokens, prefix, slots[:prefix], context_slots=slots)
    metadata = backend.plan_extend(ForwardMode.EXTEND, [segment])
    inputs = LayerInputs(0, q, k[prefix:], v[prefix:], k, v, spec.head_dim**-0.5)
    return functools.partial(backend.extend, inputs, metadata)


def _median_calls(calls: Sequence[Callable[[], object]], seconds: float, spec: AttentionSpec) -> list[float]:
    """Each call's median time per query head and unit of head dim of `spec`: every call in turn,
    round after round, as the overlap is timed; within a round, a few calls of one after an
    untimed one, as the model's layers call it one after another (a call right after a much longer
    one pays for the caches and buffers that one left behind, which back-to-back layers of one
    forward do not)."""
    units = spec.num_heads * spec.head_dim
    times: list[list[float]] = [[] for _ in calls]
    start = time.perf_counter()
    while not times[0] or time.perf_counter() - start < seconds:
        for call, samples in zip(calls, times, strict=True):
            _seconds(call, spec.device)
            samples.extend(_seconds(call, spec.device) for _ in range(_LAYERS_IN_TURN))
    return [statistics.median(t) / units for t in times]


_LAYERS_IN_TURN = 3


def engine_attention(
    args: ServerArgs, device: torch.device, layer: dict[str, int] | None = None
) -> AttentionBackend:
    """The attention backend an engine of `args` runs on `device` (the model runner's choice,
    made again in this process) for a layer of `layer`'s heads (ATTENTION_LAYER's by default)."""
    layer = layer or ATTENTION_LAYER
    spec = AttentionSpec(
        num_layers=1,
        num_heads=layer["heads"],
        num_kv_heads=layer["kv_heads"],
        head_dim=layer["head_dim"],
        dtype=pick_dtype(args.dtype, device),
        device=device,
        kernels=engine_kernels(args, device),
        decode_staging_tokens=0,
        batch_invariant=args.enable_deterministic_inference,
    )
    return choose_attention_backend(args.attention_backend, spec).backend(spec)


def _through(x: torch.Tensor, *linears: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    for linear in linears:
        x = linear(x)
    return x


def _engine_linear(
    weight: torch.Tensor, packing: WeightPacking | None
) -> Callable[[torch.Tensor], torch.Tensor]:
    """x W^T as the engine's linear computes it: with `packing`, its packed kernel; else F.linear."""
    if packing is not None:
        return packing.pack(weight).matmul
    return lambda x: torch.nn.functional.linear(x, weight)


def engine_linears(args: ServerArgs, device: torch.device) -> tuple[torch.dtype, WeightPacking | None]:
    """The dtype an engine of `args` runs in on `device`, and on a CPU in bf16 how it packs its
    linear weights: the model runner's own choices, made again in this process. The peak must be
    the matmul the engine runs. torch's bf16 matmul on a CPU without AVX-512 BF16 is emulated, a
    hundred times slower than the native kernel the engine runs there (docs/simulator.md)."""
    dtype = pick_dtype(args.dtype, device)
    if device.type != "cpu" or dtype != torch.bfloat16:
        return dtype, None
    kernels = engine_kernels(args, device)
    return dtype, WeightPacking(kernels) if cpu_packing_supported(dtype, device, kernels) else None


def engine_kernels(args: ServerArgs, device: torch.device) -> CpuKernels | None:
    """The native CPU kernels an engine of `args` runs on `device` (None: torch's ops), as the model
    runner picks them."""
    return select_cpu_kernels(args.cpu_kernels, device, args.cpu_isa)


def _seconds(work: Callable[[], object], device: torch.device) -> float:
    """One call of `work`, timed to its end on the device."""
    began = time.perf_counter()
    work()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - began


def _rate(work: Any, units: float, seconds: float, device: torch.device) -> float:
    """`units` over the median time of one call of `work`, calls repeated for `seconds`: the
    median, as calibration takes its runs', so that a short slow spell of the host moves the rate
    no more than it moves those runs (a mean over the whole time once read one width's linears at
    half their neighbours' rate: docs/simulator.md)."""

    # A GPU runs work asynchronously: time whole batches of it, each ended by a synchronize.
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    batch = 10 if device.type == "cuda" else 1
    work()
    sync()
    times: list[float] = []
    start = time.perf_counter()
    while not times or time.perf_counter() - start < seconds:
        began = time.perf_counter()
        for _ in range(batch):
            work()
        sync()
        times.append((time.perf_counter() - began) / batch)
    return units / statistics.median(times)
