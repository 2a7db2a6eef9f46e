"""`radixserve simulate`: a model config (no weights), a hardware profile and a trace in; the real
Scheduler's throughput, latencies, KV usage and cache hits out, as a table, JSON and an HTML page."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from radixserve.config.arg_types import positive_int
from radixserve.config.server_args import ServerArgs, chunked_prefill_tokens

if TYPE_CHECKING:
    from radixserve_tools.simulator.hardware import HardwareProfile
    from radixserve_tools.simulator.steadiness import HostSteadiness


def _pair(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def add_simulate_parser(sub: Any) -> None:
    sim = sub.add_parser(
        "simulate",
        help="predict a deployment: the real scheduler over a trace, on a roofline cost model",
        description="Runs radixserve's Scheduler on a virtual clock: each forward costs what a "
        "roofline of the model on the hardware profile says. No weights are needed.",
    )
    sim.add_argument(
        "--model-config",
        required=True,
        help="an HF config.json, a folder holding one, or a built-in shape: "
        "llama-3.1-8b, llama-3.1-70b, llama-3.2-1b, qwen2.5-7b, smollm2-135m",
    )
    sim.add_argument(
        "--hardware", default="H100", help="H100, H200, A100, L4, a profile file from calibrate, or zero"
    )
    sim.add_argument("--max-total-tokens", type=int, default=None, help="KV slots (default: what fits)")
    trace = sim.add_argument_group("trace (synthetic unless --trace-file)")
    trace.add_argument(
        "--trace-file", type=Path, default=None, help="JSON lines: arrival_s, input_ids|input_len, output_len"
    )
    trace.add_argument("--num-requests", type=int, default=1000)
    trace.add_argument(
        "--request-rate", type=float, default=float("inf"), help="req/s, Poisson (default: all at once)"
    )
    trace.add_argument("--input-len", type=_pair, default=(512, 512), metavar="LO[:HI]")
    trace.add_argument("--output-len", type=_pair, default=(128, 128), metavar="LO[:HI]")
    trace.add_argument("--prefix-groups", type=int, default=0, help="groups of requests sharing a prefix")
    trace.add_argument("--prefix-len", type=int, default=0)
    trace.add_argument("--turns", type=int, default=1, help="turns per conversation (each extends the last)")
    trace.add_argument("--turn-gap", type=float, default=10.0, help="seconds between a conversation's turns")
    trace.add_argument("--seed", type=int, default=0, help="seeds the trace and the draws of forward times")
    sched = sim.add_argument_group("scheduler (ServerArgs)")
    sched.add_argument("--schedule-policy", default=ServerArgs.schedule_policy)
    sched.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=ServerArgs.chunked_prefill_size,
        help="-1: off; default: what a server takes on the modelled device",
    )
    sched.add_argument("--max-prefill-tokens", type=int, default=ServerArgs.max_prefill_tokens)
    sched.add_argument("--max-running-requests", type=int, default=None)
    sched.add_argument("--schedule-conservativeness", type=float, default=1.0)
    sched.add_argument("--page-size", type=int, default=1)
    sched.add_argument("--disable-radix-cache", action="store_true")
    sim.add_argument("--out", type=Path, default=None, help="write simulation.{json,md,html} here")
    sim.set_defaults(func=_simulate)

    cal = sub.add_parser(
        "calibrate",
        help="fit a hardware profile of this machine for simulate",
        description="Measures this machine's matmul FLOP/s and copy bandwidth, times a few prefill- "
        "and decode-bound batches of a real model, and fits the profile's efficiencies and overheads "
        "so that the simulator predicts those times.",
    )
    cal.add_argument("--model-path", default=None, help="the model to time (default: the packaged SmolLM2)")
    cal.add_argument("--dtype", default="auto")
    cal.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (as for serve)")
    cal.add_argument("--max-total-tokens", type=int, default=None)
    cal.add_argument(
        "--passes",
        type=positive_int,
        default=3,
        help="timed passes of the calibration runs, each followed by a measurement of the peaks; the "
        "profile takes their medians (more on a machine whose speed moves)",
    )
    cal.add_argument("--out", type=Path, default=Path("cpu-profile.json"))
    cal.set_defaults(func=_calibrate)


def _simulate(args: argparse.Namespace) -> int:
    from radixserve.config.server_args import InvalidArgumentError
    from radixserve_tools.simulator.hardware import load_profile
    from radixserve_tools.simulator.model_configs import load_config
    from radixserve_tools.simulator.report import table, write_outputs
    from radixserve_tools.simulator.simulate import kv_capacity, simulate
    from radixserve_tools.simulator.trace import SyntheticTrace, load_trace, synthetic

    config = load_config(args.model_config)
    profile = None if args.hardware == "zero" else load_profile(args.hardware)
    if args.max_total_tokens is None and profile is None:
        raise InvalidArgumentError("--hardware zero needs --max-total-tokens")
    capacity = args.max_total_tokens or kv_capacity(config, profile)  # type: ignore[arg-type]
    if args.trace_file is not None:
        trace = load_trace(args.trace_file, args.seed)
    else:
        spec = SyntheticTrace(
            args.num_requests,
            args.request_rate,
            args.input_len,
            args.output_len,
            args.prefix_groups,
            args.prefix_len,
            args.turns,
            args.turn_gap,
            args.seed,
        )
        trace = synthetic(spec)
    device_type = "cuda" if profile is None else profile.device_type
    result = simulate(config, profile, trace, capacity, seed=args.seed, **scheduler_args(args, device_type))
    title = f"{config.architecture} on {args.hardware}, {len(trace)} requests"
    print(table(result, title))
    if args.out is not None:
        for path in write_outputs(result, title, args.out):
            print(f"wrote {path}")
    return 0


def calibrate_engine(
    engine: Any, name: str = "cpu", passes: int = 3
) -> tuple[Any, list[tuple[Any, float]], HostSteadiness]:
    """A profile fitted to this engine's model on this machine, each calibration run with its
    predicted seconds, and how steady the machine was meanwhile: `passes` timed passes of the
    calibration runs, the peaks measured after each (their medians: peaks.median_measurements)."""
    from radixserve.models.source import load_model_config
    from radixserve_tools.simulator.calibration_passes import CalibrationTimer
    from radixserve_tools.simulator.steadiness import HostSteadiness

    if passes < 1:
        raise ValueError(f"calibrate needs at least one timed pass, got {passes}")
    timer = CalibrationTimer.start(engine)
    samples = []
    for _ in range(passes):
        timer.time_pass()
        samples.append(measure_engine_peaks(engine, name))
    profile, rows = fit_engine(engine, median_engine_peaks(engine, samples), timer.runs())
    width = load_model_config(engine.source).hidden_size
    return profile, rows, HostSteadiness.of(timer.passes, samples, width)


def median_engine_peaks(engine: Any, samples: list[Any]) -> Any:
    """measure_engine_peaks' `samples`, taken between the calibration passes, as one: each figure's
    median (peaks.median_measurements), at the dtype of the engine's linears."""
    from radixserve.executor.model_runner import pick_device
    from radixserve_tools.simulator.peaks import engine_linears, median_measurements

    dtype, _ = engine_linears(engine.args, pick_device(engine.args.device))
    return median_measurements(samples, dtype)


def measure_engine_peaks(engine: Any, name: str) -> Any:
    """What calibrate measures of this machine for the engine's linears and kernels (the fit's
    input, HardwareProfile.measured): peak FLOP/s, memory, rates by width, pointwise costs, a
    stack of linears' time by rows (the weights' bandwidth, and how compute and memory combine),
    and a prompt's attention by its length and an extend's over a cached prefix by its pairs."""
    import os

    import torch

    from radixserve.executor.model_runner import pick_device
    from radixserve.models.source import load_model_config
    from radixserve_tools.simulator.hardware import HardwareProfile
    from radixserve_tools.simulator.peaks import (
        engine_attention,
        engine_kernels,
        engine_linears,
        linear_widths,
        measure_decode_overlap,
        measure_extend_attention,
        measure_flops,
        measure_linear_rates,
        measure_pointwise,
        measure_prompt_attention,
        weights_bandwidth,
    )

    device = pick_device(engine.args.device)
    dtype, packing = engine_linears(engine.args, device)
    # The calibration model's own layer: a call's cost does not scale with its heads (docs/simulator.md).
    config = load_model_config(engine.source)
    heads = (config.num_attention_heads, config.num_key_value_heads, config.head_dim)
    layer = dict(zip(("heads", "kv_heads", "head_dim"), heads, strict=True))
    attention = engine_attention(engine.args, device, layer)
    flops = measure_flops(device, dtype=dtype, packing=packing)
    overlap = measure_decode_overlap(device, dtype=dtype, packing=packing)
    memory = float(
        torch.cuda.get_device_properties(device).total_memory
        if device.type == "cuda"
        else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    )
    return HardwareProfile(
        name,
        flops,
        weights_bandwidth(overlap, dtype),
        memory,
        device_type=device.type,
        # The calibration model's own width beside the usual ones: the rate is not smooth in the
        # width (docs/simulator.md), and the fitted efficiencies are shares of the rate there.
        linear_rates=measure_linear_rates(device, dtype=dtype, packing=packing, widths=linear_widths(config)),
        pointwise=measure_pointwise(device, dtype=dtype, kernels=engine_kernels(engine.args, device)),
        decode_overlap=overlap,
        prompt_attention=measure_prompt_attention(attention),
        extend_attention=measure_extend_attention(attention),
    )


def fit_engine(engine: Any, peaks: Any, runs: list[Any]) -> tuple[Any, list[tuple[Any, float]]]:
    """calibrate.fit on this engine's model and attention, from measured `peaks` and timed `runs`,
    with the cost per row held at what the engine's scheduler measured of its own time; with each
    run's predicted seconds."""
    from radixserve.executor.model_runner import pick_device
    from radixserve.models.source import load_model_config
    from radixserve_tools.simulator.calibrate import fit, predicted_seconds, recorded_forwards
    from radixserve_tools.simulator.calibration_passes import calibration_runs

    config = load_model_config(engine.source)
    server_args = scheduler_args(engine.args, pick_device(engine.args.device).type)
    recorded = [
        recorded_forwards(config, shape, i, engine.max_total_tokens, **server_args)
        for i, shape in enumerate(calibration_runs(engine.context_len))
    ]
    profile = fit(config, runs, recorded, peaks, engine_cascades(engine), engine_row_cost(engine))
    pairs = zip(runs, recorded, strict=True)
    predicted = [predicted_seconds(config, profile, run.shape, forwards) for run, forwards in pairs]
    return profile, list(zip(runs, predicted, strict=True))


def engine_row_cost(engine: Any) -> float | None:
    """The scheduler's own seconds per row of a decode step (scheduler/stats.py's HostTimeLine)
    over everything the engine has run: held_row_cost of its get_stats' decode_host_time."""
    return held_row_cost(engine.get_stats()["decode_host_time"])


def held_row_cost(decode_host_time: dict[str, Any]) -> float | None:
    """The row cost calibrate holds, from a HostTimeLine's describe(): None before the line saw two
    batch sizes. Never below 0: a slope that noise took below it means no cost per row the runs
    could show."""
    per_row = decode_host_time.get("per_row_s")
    return None if per_row is None else max(0.0, float(per_row))


def engine_cascades(engine: Any) -> bool:
    """Whether the engine's attention reads a prefix a batch shares once (radixserve's CPU backend
    does; its decode path says so)."""
    return "shared-prefix cascade" in engine.get_stats().get("decode_path", "")


def scheduler_args(args: ServerArgs | argparse.Namespace, device_type: str) -> dict[str, Any]:
    """The flags that decide how a server batches, for a simulation of it (from a server's args or
    simulate's, which take the same names), with the prefill chunk resolved as the server's
    scheduler resolves it on a device of `device_type`: the simulator's own scheduler runs on the
    CPU whatever device it models."""
    chunk = chunked_prefill_tokens(args.chunked_prefill_size, device_type)
    return {
        "schedule_policy": args.schedule_policy,
        "chunked_prefill_size": -1 if chunk is None else chunk,
        "max_prefill_tokens": args.max_prefill_tokens,
        "max_running_requests": args.max_running_requests,
        "schedule_conservativeness": args.schedule_conservativeness,
        "page_size": args.page_size,
        "disable_radix_cache": args.disable_radix_cache,
    }


def _calibrate(args: argparse.Namespace) -> int:
    from radixserve.runtime.engine import Engine

    flags: dict[str, Any] = {"dtype": args.dtype, "device": args.device, "log_level": "warning"}
    if args.max_total_tokens is not None:
        flags["max_total_tokens"] = args.max_total_tokens
    with Engine(args.model_path, **flags) as engine:
        profile, rows, steadiness = calibrate_engine(engine, passes=args.passes)
    profile.save(args.out)
    print("| requests x prompt + output | measured s | predicted s | error |\n|---|---|---|---|")
    for run, predicted in rows:
        error = (predicted - run.seconds) / run.seconds
        print(f"| {run.shape.label} | {run.seconds:.3f} | {predicted:.3f} | {error:+.1%} |")
    print(_describe(profile))
    print(steadiness.describe())
    print(f"wrote {args.out}")
    return 0


def _describe(profile: HardwareProfile) -> str:
    """A fitted profile's figures in one line."""
    decode_flops = profile.decode_flops_efficiency
    decode_fixed = profile.decode_overhead_s
    if decode_fixed is None:
        decode_fixed = profile.forward_overhead_s
    attention = profile.attention_efficiency or profile.flops_efficiency
    context = profile.context_attention_efficiency or attention
    decode_attention = profile.decode_attention_efficiency or context
    cascade = ""
    if profile.cascade_attention:
        shared = profile.shared_prefix_attention_efficiency or context
        key_ns = profile.shared_prefix_key_s * 1e9
        cascade = f", a cascade's x {shared:.3f} + {key_ns:.0f} ns per key and layer"
    linears = f"peak {profile.peak_flops / 1e9:,.0f} GFLOP/s"
    if profile.linear_rates:
        rates = ", ".join(f"{width}: {rate / 1e9:,.0f}" for width, rate in profile.linear_rates)
        linears = f"linears by hidden size {rates} GFLOP/s"
    pointwise, norm = profile.pointwise, profile.memory_compute_norm
    causal = f"attention x {attention:.3f} (causal in blocks of {profile.attention_block})"
    if profile.prompt_attention:
        prompt = profile.prompt_attention
        causal = f"a prompt's attention as measured at {prompt[0][0]}-{prompt[-1][0]} tokens"
    extend = f"over a cached prefix x {context:.3f}"
    if profile.extend_attention:
        pairs = profile.extend_attention
        extend = f"an extend's over a cached prefix as measured at {pairs[0][0]:,}-{pairs[-1][0]:,} pairs"
    return (
        f"{linears} x {profile.flops_efficiency:.2f} "
        f"(decode steps x {profile.flops_efficiency if decode_flops is None else decode_flops:.2f}, "
        f"{causal}, "
        f"{extend}, "
        f"a decode step's x {decode_attention:.3f}{cascade}), "
        f"{profile.memory_bandwidth / 1e9:,.1f} GB/s x {profile.bandwidth_efficiency:.2f} "
        f"(a decode step's with compute: {'the larger' if norm is None else f'their {norm:g}-norm'}"
        f"{', as a stack of linears showed' if profile.decode_overlap else ''}), "
        f"pointwise ns per value: norm {pointwise.norm_s * 1e9:.2f}, rotary {pointwise.rotary_s * 1e9:.2f}, "
        f"activation {pointwise.activation_s * 1e9:.2f} (us per call: {pointwise.norm_call_s * 1e6:.1f}, "
        f"{pointwise.rotary_call_s * 1e6:.1f}, {pointwise.activation_call_s * 1e6:.1f}), "
        f"{profile.forward_overhead_s * 1e3:.2f} ms per prefill forward, "
        f"{decode_fixed * 1e3:.2f} ms per decode step, "
        f"{profile.row_overhead_s * 1e6:.0f} us per sampled row, "
        f"{profile.idle_wake_s * 1e3:.2f} ms more for a forward after {profile.idle_wake_after_s:g} s idle, "
        f"each forward's time spread by {profile.forward_noise:.3f} (its log's standard deviation)"
    )
