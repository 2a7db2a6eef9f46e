"""Validates `radixserve simulate` on this machine: calibrate a profile on the calibration runs, then
predict W1, W2 and W3 (which the fit did not use) and compare with the measured runs.

    python benchmarks/simulator_validation.py [--work bench-work] [--repeats 3]
    python benchmarks/simulator_validation.py --device cuda --model llama-1b --hardware H200

The model is the random SmolLM2-135M-shaped checkpoint of `radixserve bench offline` (bf16), or
with --model llama-1b random weights in Llama-3.2-1B's shape, on one Engine with
--max-total-tokens 40000. With --hardware, the same workloads are also predicted from that
built-in profile as published (its default efficiencies, no calibration).

The calibration passes are interleaved with the measurements they predict: each round times one
calibration pass and a measurement of the peaks, then W1, W2 and W3 (each run repeated until about
ROUND_S is spent on it, as a calibration pass repeats its short runs), and with --serving a serving
run; then a last pass. Within a round each run's repeats are spread over it (W3's between W1's and
W2's runs and the serving run), so that they meet different spells of the host's speed. The profile
takes the peaks' medians over the passes' span, as calibrate does. This host's speed drifts by more
than the 9% target over the minutes a validation takes, and a calibration timed all at the start
would fit the machine of those minutes only. Each pass's total time against the median pass's is
printed, which shows the drift. Beside the profile fitted on all passes ("calibrated"), each round
is also predicted by a profile fitted on the passes just before and after it and the peaks measured
after those ("its round's passes"): its error is the cost model's with the drift between rounds left
out. Each serving run's trace is replayed in this process right after it, in its round.

Throughput: each workload's total tokens over its wall time (median of all its runs, cold cache),
against the simulated makespan of each run's arrivals as the server recorded them (median).
TTFT: the same prompts with one output token each, each request's time from its arrival to the
scheduler's first output (the trace's stamps; the engine's own, which adds the hop through the
detokenizer, is printed beside it): the measured p50 against the simulated p50. The engine idles
a few tenths of a second before each TTFT run, and its simulation starts as idle as long.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from radixserve.config.server_args import ServerArgs
from radixserve.executor.model_runner import pick_device
from radixserve.models.source import load_model_config
from radixserve.runtime.engine import Engine
from radixserve_tools.bench.model import ensure_random_llama_1b, ensure_random_smollm2
from radixserve_tools.bench.workloads import Workload, make_workload, time_engine_runs
from radixserve_tools.simulator.calibration_passes import (
    CalibrationTimer,
    neighbour_passes,
    samples_for,
    spread_order,
)
from radixserve_tools.simulator.cli import (
    engine_cascades,
    fit_engine,
    measure_engine_peaks,
    median_engine_peaks,
    scheduler_args,
)
from radixserve_tools.simulator.hardware import HardwareProfile, load_profile
from radixserve_tools.simulator.replay import compare_forwards, decode_host_time, replay
from radixserve_tools.simulator.simulate import SimResult, simulate
from radixserve_tools.simulator.steadiness import HostSteadiness
from radixserve_tools.simulator.trace import TraceRequest, load_trace_lines, pack_traces, unpack_traces


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("bench-work"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--model", choices=("smollm2-135m", "llama-1b"), default="smollm2-135m")
    parser.add_argument("--max-total-tokens", type=int, default=40000)
    parser.add_argument("--hardware", default=None, help="also predict from this built-in profile")
    parser.add_argument(
        "--serving", action="store_true", help="also a `bench serving` run against a live server (see below)"
    )
    args = parser.parse_args()
    device = pick_device(args.device)
    if args.model == "llama-1b":
        model = ensure_random_llama_1b(args.work, build_device=device.type)
    else:
        model = ensure_random_smollm2(args.work, "bfloat16")
    trace_path = args.work / "simulator-validation-trace.jsonl"
    trace_path.unlink(missing_ok=True)
    flags = {
        "dtype": "bfloat16",
        "device": args.device,
        "max_total_tokens": args.max_total_tokens,
        "record_trace": str(trace_path),
    }
    rows: list[Row] = []
    with Engine(str(model), **flags, log_level="warning") as engine:
        timer = CalibrationTimer.start(engine)
        workloads = {name: Measured(make_workload(name)) for name in ("W1", "W2", "W3")}
        servings: list[_Serving] = []
        # The peaks, measured after each pass as calibrate measures them: the host drifts within
        # minutes, and the profile takes each figure's median over the passes' span.
        peak_samples: list[HardwareProfile] = []

        idle = _EngineIdle()

        def time_pass() -> None:
            timer.time_pass()
            idle.returned()
            peak_samples.append(measure_engine_peaks(engine, name=f"calibrated-{device.type}"))

        for round_ in range(args.repeats):
            time_pass()
            serving = None
            if args.serving:
                cascade = engine_cascades(engine)
                serving = functools.partial(_serve_into, servings, model, args, round_, cascade)
            _measure_round(engine, list(workloads.values()), trace_path, round_, idle, serving)
        if args.serving:
            time_pass()  # after the last serving run as before the first
        config = load_model_config(engine.source)
        width = config.hidden_size
        steadiness = HostSteadiness.of(timer.passes, peak_samples, width)
        ratios = ", ".join(f"{ratio:.3f}" for ratio in steadiness.pass_ratios)
        print(f"calibration passes against the median one: {ratios}")
        read = zip(steadiness.weights_rates, steadiness.linear_rates, strict=True)
        for k, (weights, linears) in enumerate(read):
            print(
                f"peaks after pass {k + 1}: the weights at {weights / 1e9:.1f} GB/s, the "
                f"linears at {linears / 1e9:.0f} GFLOP/s at {width} wide"
            )
        print(steadiness.describe())
        peaks = median_engine_peaks(engine, peak_samples)
        calibrated, calibration = fit_engine(engine, peaks, timer.runs())
        print("| calibration run | measured s | predicted s |\n|---|---|---|")
        for run, predicted in calibration:
            print(f"| {run.shape.label} | {run.seconds:.3f} | {predicted:.3f} |")
        print(calibrated)
        # Each round's own profile, fitted on the passes timed just before and after it: its
        # errors are the cost model's with the host's drift between the rounds left out.
        by_round = []
        for k in range(args.repeats):
            passes = neighbour_passes(k, len(timer.passes))
            round_peaks = median_engine_peaks(engine, [peak_samples[p] for p in passes])
            by_round.append(fit_engine(engine, round_peaks, timer.runs(passes))[0])
        # Per profile, the one each round is predicted with.
        profiles = [("calibrated", [calibrated] * args.repeats)]
        if calibrated.forward_noise:
            # Beside it, the same profile's noiseless predictions: what the noise changes.
            noiseless = dataclasses.replace(calibrated, forward_noise=0.0)
            profiles.append(("calibrated, no noise", [noiseless] * args.repeats))
        profiles.append((ROUND_PROFILE, by_round))
        if args.hardware:
            profiles.append((args.hardware, [load_profile(args.hardware)] * args.repeats))
        sched = scheduler_args(engine.args, pick_device(engine.args.device).type)
        # What the fits held the cost per row at (the scheduler's own time, cli.engine_row_cost).
        host_time = engine.get_stats()["decode_host_time"]
        print(f"the engine's scheduler between decode steps: {host_time}")
    for name, entry in workloads.items():
        print(
            f"{name} TTFT p50: the scheduler's {statistics.median(entry.ttfts):.1f} ms, "
            f"the engine's {statistics.median(entry.engine_ttfts):.1f} ms"
        )
    limit = args.max_total_tokens
    rows += workload_rows(workloads, profiles, config, limit, sched)
    replays: list[dict[str, Any]] = []
    if servings:
        rows += _serving_rows(servings, profiles, config, sched, limit)
        replays = _replays(servings, config, calibrated, by_round, limit, sched)
    print_rows(rows)
    # Everything above as JSON, so that a later fit or cost model can be tried on these very
    # measurements without running them again.
    record = {
        "model": args.model,
        "profile": dataclasses.asdict(calibrated),
        "round_profiles": [dataclasses.asdict(p) for p in by_round],
        "calibration": [
            {
                **dataclasses.asdict(run.shape),
                "measured_s": run.seconds,
                "predicted_s": predicted,
                "log_squares": run.log_squares,
                "log_df": run.log_df,
            }
            for run, predicted in calibration
        ],
        # Every sample of every calibration run, per pass (the figures above are their medians).
        "pass_samples": timer.pass_samples,
        # What each measurement of the peaks after a pass read (the profile holds their medians).
        "peak_samples": [dataclasses.asdict(p) for p in peak_samples],
        "steadiness": dataclasses.asdict(steadiness),
        "decode_host_time": host_time,
        "workloads": [dataclasses.asdict(row) for row in rows],
        # Every workload run's arrivals and measurement, so that a refit predicts them again.
        "workload_runs": save_workloads(workloads),
        "replays": replays,
    }
    results = args.work / "simulator-validation.json"
    results.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {results}")


@dataclass(frozen=True)
class Row:
    """A workload's measured and predicted figures (medians), and the measured runs themselves."""

    workload: str
    profile: str
    measured_tok_s: float
    predicted_tok_s: float
    ttft_ms: float
    sim_ttft_ms: float
    tok_s_runs: list[float]
    ttft_ms_runs: list[float]


def _spread(runs: list[float]) -> str:
    """The runs' least and greatest against their median, as percentages."""
    middle = statistics.median(runs)
    return f"{min(runs) / middle - 1:+.0%}..{max(runs) / middle - 1:+.0%}"


def print_rows(rows: list[Row]) -> None:
    # Each measured figure's runs, as their least and greatest against their median: an error
    # inside that range is within the measurement's own noise.
    columns = "workload | profile | measured tok/s | runs | predicted | error | measured TTFT p50 ms | runs"
    print(f"| {columns} | predicted | error |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row.workload} | {row.profile} | {row.measured_tok_s:,.0f} | {_spread(row.tok_s_runs)} "
            f"| {row.predicted_tok_s:,.0f} | {row.predicted_tok_s / row.measured_tok_s - 1:+.1%} "
            f"| {row.ttft_ms:,.1f} | {_spread(row.ttft_ms_runs)} | {row.sim_ttft_ms:,.1f} "
            f"| {row.sim_ttft_ms / row.ttft_ms - 1:+.1%} |",
            flush=True,
        )


def workload_rows(
    workloads: dict[str, Measured],
    profiles: list[tuple[str, list[HardwareProfile]]],
    config: Any,
    max_total_tokens: int,
    sched: dict[str, Any],
) -> list[Row]:
    """Per workload and profile, the measured figures (medians over the runs) against the
    simulations of each run's recorded arrivals. `profiles`: per label, each round's profile."""
    rows = []
    sims = functools.partial(_simulations, config, limit=max_total_tokens, sched=sched)
    for name, entry in workloads.items():
        total = entry.workload.in_tokens + entry.workload.out_tokens
        tok_s_runs = [total / seconds for seconds in entry.seconds]
        tok_s, ttft = statistics.median(tok_s_runs), statistics.median(entry.ttfts)
        for label, per_round in profiles:
            timed = [sim for run, k in entry.timed_runs for sim in sims(per_round[k], run)]
            firsts = [sim for run, k in entry.ttft_runs for sim in sims(per_round[k], run)]
            makespan = statistics.median(sim.makespan_s for sim in timed)
            sim_ttft = statistics.median(statistics.median(sim.ttft_values_ms) for sim in firsts)
            rows.append(Row(name, label, tok_s, total / makespan, ttft, sim_ttft, tok_s_runs, entry.ttfts))
    return rows


# Poisson arrivals of prompts in groups that share a system prompt, streamed over HTTP: a load
# that calibration (batches arriving at once, offline) never saw.
SERVING = [
    "--dataset", "generated-shared-prefix", "--gsp-num-groups", "4", "--gsp-prompts-per-group", "8",
    "--gsp-system-prompt-len", "512", "--gsp-question-len", "64", "--gsp-output-len", "64",
    "--request-rate", "1.0", "--backend", "completions", "--disable-tqdm",
]  # fmt: skip


# A round times each of a workload's runs until about this long is spent on it (calibrate's
# samples_for; its first round sets the count), as a calibration pass samples its runs: W3,
# one request, takes a tenth of W1's time and is what this host's noise moves most.
ROUND_S = 4.0

# The profile fitted on the calibration passes timed right before and right after each round
# (calibration_passes.neighbour_passes), which predicts that round's runs: beside the profile fitted on all
# passes, it tells the cost model's error from the host's drift between the rounds.
ROUND_PROFILE = "its round's passes"


@dataclass
class Measured:
    """A workload's measurements over the rounds: each throughput run's seconds and its requests'
    arrivals as the server recorded them, and each TTFT run's p50 and arrivals. A TTFT run's p50 is
    the scheduler's (arrival to first output, from the trace), which is what the simulator predicts;
    the engine's (engine_ttfts) adds the hop through the detokenizer and, where the overlap
    schedule runs (on CUDA), the launch of the next forward, during which the outputs are sent."""

    workload: Workload
    seconds: list[float] = field(default_factory=list)
    # Each run's arrivals, with the round it was timed in.
    timed_runs: list[tuple[list[TraceRequest], int]] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    ttft_runs: list[tuple[list[TraceRequest], int]] = field(default_factory=list)
    engine_ttfts: list[float] = field(default_factory=list)
    # Runs per round, set by the first round (0 until then).
    per_round: int = 0
    ttft_per_round: int = 0


@dataclass
class _EngineIdle:
    """When the offline engine last returned work (perf_counter seconds): a TTFT run's simulation
    starts as idle as the engine was since then."""

    last_return: float = 0.0

    def returned(self) -> None:
        self.last_return = time.perf_counter()


def _measure_round(
    engine: Any,
    entries: list[Measured],
    trace_path: Path,
    round_: int,
    idle: _EngineIdle,
    serving: Callable[[], None] | None,
) -> None:
    """Throughput runs and TTFT runs of each workload, each on a cold cache, and the serving run
    (if any), each run's repeats spread over the round (calibration_passes.spread_order). The
    first round times each workload's runs once first, and how long they took sets how many a
    round takes.

    Each run's arrivals are replayed as the server recorded them (--record-trace): a batch handed
    to the engine at once reaches the scheduler over a few milliseconds, and its first step sees
    those the idle scheduler took at once (their received_s). On W2 that decides how many requests
    compute the shared prefix: simulating arrivals all at 0 predicted 30% less throughput, and the
    first request alone 38% less TTFT."""
    runs: list[tuple[Callable[[], object], int]] = []
    for entry in entries:
        done = 0
        if entry.per_round == 0:
            _time_throughput(engine, entry, trace_path, round_, idle)
            ttft_seconds = _time_ttft(engine, entry, trace_path, round_, idle)
            entry.per_round = samples_for(entry.seconds[0], ROUND_S)
            entry.ttft_per_round = samples_for(ttft_seconds, ROUND_S)
            done = 1
        args = (engine, entry, trace_path, round_, idle)
        runs.append((functools.partial(_time_throughput, *args), entry.per_round - done))
        runs.append((functools.partial(_time_ttft, *args), entry.ttft_per_round - done))
    if serving is not None:
        runs.append((serving, 1))
    for k, _ in spread_order([count for _, count in runs]):
        runs[k][0]()


def _time_throughput(engine: Any, entry: Measured, trace_path: Path, round_: int, idle: _EngineIdle) -> None:
    count = len(entry.workload.prompts)
    seen = _settled_lines(trace_path)
    (run,) = time_engine_runs(engine, entry.workload, 1)  # its warm-up, then the run
    idle.returned()
    entry.seconds.append(run.seconds)
    # The warm-up's requests come first in the trace, then the run's.
    entry.timed_runs.append((_since_first(_recorded(trace_path, seen + count, count)), round_))


def _time_ttft(engine: Any, entry: Measured, trace_path: Path, round_: int, idle: _EngineIdle) -> float:
    """The same prompts, one output token each, so that each request's latency is its TTFT. Returns
    the run's wall time.

    The engine idles before it while the trace settles (a few tenths of a second), and the next
    forward pays its share of the wake cost (HardwareProfile.idle_wake_s), which on a GPU is a
    large part of a short prompt's TTFT. Its simulation starts as idle: the first arrival at that
    idle's length."""
    count = len(entry.workload.prompts)
    engine.flush_cache()
    seen = _settled_lines(trace_path)
    first = {"temperature": 0.0, "max_new_tokens": 1, "ignore_eos": True}
    start = time.perf_counter()
    idle_s = start - idle.last_return
    results = engine.generate(input_ids=entry.workload.prompts, sampling_params=first)
    idle.returned()
    seconds = idle.last_return - start
    assert isinstance(results, list)
    entry.engine_ttfts.append(statistics.median(r["meta_info"]["e2e_latency"] for r in results) * 1000)
    lines = _recorded(trace_path, seen, count)
    entry.ttfts.append(scheduler_ttft_ms(lines))
    entry.ttft_runs.append((_since_first(lines, idle_s), round_))
    return seconds


def save_workloads(workloads: dict[str, Measured]) -> dict[str, Any]:
    """Every run's measurement and recorded arrivals, per workload (load_workloads reads it)."""
    out = {}
    for name, entry in workloads.items():
        runs = entry.timed_runs + entry.ttft_runs
        out[name] = {
            "seconds": entry.seconds,
            "ttft_ms": entry.ttfts,
            "engine_ttft_ms": entry.engine_ttfts,
            "rounds": [k for _, k in runs],
            "arrivals": pack_traces([trace for trace, _ in runs]),
        }
    return out


def load_workloads(saved: dict[str, Any]) -> dict[str, Measured]:
    workloads = {}
    for name, runs in saved.items():
        traces = list(zip(unpack_traces(runs["arrivals"]), runs["rounds"], strict=True))
        timed = len(runs["seconds"])
        workloads[name] = Measured(
            make_workload(name),
            seconds=runs["seconds"],
            timed_runs=traces[:timed],
            ttfts=runs["ttft_ms"],
            ttft_runs=traces[timed:],
            engine_ttfts=runs["engine_ttft_ms"],
        )
    return workloads


@dataclass(frozen=True)
class _Serving:
    """What a `bench serving` run measured: the client's report, the server's recorded trace and
    its dashboard snapshot; and the trace replayed in this process right after (_replay)."""

    report: dict[str, Any]
    lines: list[str]
    snapshot: dict[str, Any]
    replayed: SimResult


def scheduler_ttft_ms(lines: list[str]) -> float:
    """The scheduler's own TTFT p50 over recorded trace lines, from the engine's arrival stamp to
    the scheduler's first output: what the simulator predicts. The engine's adds the hops through
    the detokenizer."""
    rows = [json.loads(line) for line in lines]
    return statistics.median((r["first_output_s"] - r["arrival_s"]) * 1000 for r in rows)


def _serving_run(model: Path, args: argparse.Namespace, index: int, cascade: bool) -> _Serving:
    """`bench serving` against `serve --record-trace` (while the offline Engine idles beside it),
    then its trace replayed (cascade: whether the engine's attention cascades)."""
    from pd_disaggregation import _free_port, _process, _serve, _wait

    work = args.work
    # Each run's trace is kept, so that another profile or cost model can replay it later.
    trace_path = work / f"serving-trace-{index}.jsonl"
    log, out = work / "serving-server.log", work / "serving.json"
    trace_path.unlink(missing_ok=True)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    flags = [
        "--model-path",
        str(model),
        "--max-total-tokens",
        str(args.max_total_tokens),
        "--device",
        args.device,
    ]
    flags += ["--record-trace", str(trace_path), "--enable-dashboard"]
    with _process(_serve(port, *flags), log) as server:
        _wait(url, server, log)
        cmd = [sys.executable, "-m", "radixserve.cli", "bench", "serving", "--base-url", url,
               "--tokenizer", str(model), *SERVING, "--output-file", str(out)]  # fmt: skip
        before, client_before, start = _cpu_seconds(server.pid), _children_cpu_seconds(), time.monotonic()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        wall, after = time.monotonic() - start, _cpu_seconds(server.pid)
        # Where the two cores went: the offline calibration's forwards had them to themselves, the
        # server's share them with its HTTP process, its detokenizer and the client.
        used = {name: after[name] - before.get(name, 0.0) for name in after}
        used["the bench client"] = _children_cpu_seconds() - client_before
        shares = ", ".join(f"{name} {seconds:.1f}" for name, seconds in used.items())
        print(f"serving run: {wall:.1f} s; CPU seconds used: {shares}")
        # The engine's own TTFT per request (arrival to the first token out of the scheduler), which
        # is what the simulator predicts; the client's adds HTTP, detokenizing and streaming.
        snapshot = httpx.get(url + "/dashboard/snapshot", timeout=30).json()
    lines = trace_path.read_text().splitlines()
    return _Serving(json.loads(out.read_text()), lines, snapshot, _replay(lines, model, args, cascade))


def _serve_into(
    servings: list[_Serving], model: Path, args: argparse.Namespace, index: int, cascade: bool
) -> None:
    servings.append(_serving_run(model, args, index, cascade))


def _cpu_seconds(root: int) -> dict[str, float]:
    """CPU seconds used so far by the process `root` and its children, each named by the module it
    runs (Linux /proc)."""
    ticks = os.sysconf("SC_CLK_TCK")
    used: dict[str, float] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            argv = (stat.parent / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:  # the process ended meanwhile
            continue
        pid, ppid = int(stat.parent.name), int(fields[1])
        if root not in (pid, ppid):
            continue
        name = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else argv[0]
        used[name] = used.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return used


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _serving_rows(
    servings: list[_Serving],
    profiles: list[tuple[str, list[HardwareProfile]]],
    config: Any,
    sched: Any,
    max_total_tokens: int,
) -> list[Row]:
    """Each profile's simulation of the very requests each serving run's server recorded, at their
    recorded arrival times. Measured: the client's output tok/s, and the scheduler's TTFT p50 (from
    the trace), which is what the simulator predicts. Each figure is the median over the runs.
    `profiles`: per label, the profile of each round (run)."""
    measured_ttfts = []
    for serving in servings:
        report, snapshot = serving.report, serving.snapshot
        engine_ttft = statistics.median(r["ttft_ms"] for r in snapshot["recent"] if r["ttft_ms"] is not None)
        measured_ttfts.append(scheduler_ttft_ms(serving.lines))
        # The client's TTFT is not comparable here: the random model's tokenizer knows 1,000 of its
        # 49,152 ids, so most tokens print nothing and the stream holds back its text.
        print(
            f"serving TTFT p50: the scheduler's {measured_ttfts[-1]:.1f} ms, "
            f"the engine's {engine_ttft:.1f} ms, the client's {report['median_ttft_ms']:.1f} ms; "
            f"the engine's ITL p50 {snapshot['latency']['itl_ms']['p50']:.1f} ms"
        )
    throughputs = [s.report["output_throughput"] for s in servings]
    measured = statistics.median(throughputs)
    rows = []
    for label, per_round in profiles:
        sims = [
            sim
            for s, profile in zip(servings, per_round, strict=True)
            for sim in _simulations(config, profile, load_trace_lines(s.lines), max_total_tokens, sched)
        ]
        predicted = statistics.median(sim.output_tokens / sim.makespan_s for sim in sims)
        ttft = statistics.median(statistics.median(sim.ttft_values_ms) for sim in sims)
        ttft_ms = statistics.median(measured_ttfts)
        rows.append(Row("serving", label, measured, predicted, ttft_ms, ttft, throughputs, measured_ttfts))
        # A diagnostic beside the targets: whether the server's decode steps ran at the offline
        # calibration's speed while HTTP, streaming and the client shared its cores.
        itls = ", ".join(f"{sim.itl_ms['p50']:.1f}" for sim in sims)
        print(f"serving, {label}: simulated ITL p50 {itls} ms")
    return rows


def _replay(lines: list[str], model: Path, args: argparse.Namespace, cascade: bool) -> SimResult:
    """A serving run's trace replayed on the real model in this process (simulator/replay.py),
    with no HTTP, detokenizer or client beside it; right after the run, next to the calibration
    passes its round's profile is fitted on."""
    server_args = ServerArgs(
        model_path=str(model),
        dtype="bfloat16",
        device=args.device,
        max_total_tokens=args.max_total_tokens,
        log_level="warning",
    )
    return replay(server_args, load_trace_lines(lines), count_shared_reads=cascade)


def _replays(
    servings: list[_Serving],
    config: Any,
    calibrated: HardwareProfile,
    by_round: list[HardwareProfile],
    limit: int,
    sched: dict[str, Any],
) -> list[dict[str, Any]]:
    """Each serving run's replay: its TTFT against the server's and the simulation's, and each
    forward it ran against what the calibrated profile, and its round's, predict for it."""
    out = []
    for serving, own in zip(servings, by_round, strict=True):
        replayed = serving.replayed
        trace = load_trace_lines(serving.lines)
        sims = _simulations(config, calibrated, trace, limit, sched)
        server = scheduler_ttft_ms(serving.lines)
        ttft = statistics.median(replayed.ttft_values_ms)
        sim_ttft = statistics.median(statistics.median(sim.ttft_values_ms) for sim in sims)
        itl, sim_itl = replayed.itl_ms["p50"], statistics.median(sim.itl_ms["p50"] for sim in sims)
        print(
            f"replayed in process: TTFT p50 {ttft:.1f} ms (the server's {server:.1f}, simulated "
            f"{sim_ttft:.1f}), ITL p50 {itl:.1f} ms (simulated {sim_itl:.1f})"
        )
        groups = compare_forwards(replayed.records, config, calibrated)
        own_groups = compare_forwards(replayed.records, config, own)
        round_errors = {g.kind: g.error for g in own_groups}
        print(f"the profile's forward noise: {calibrated.forward_noise:.3f}")
        host = decode_host_time(replayed.records)
        if host is not None:
            print(host.describe(calibrated))
        print("| forwards | count | measured s | predicted s | error | spread | its round's profile |")
        print("|---|---|---|---|---|---|---|")
        for g in groups:
            print(
                f"| {g.kind} | {g.count} | {g.measured_s:.3f} | {g.predicted_s:.3f} | {g.error:+.1%} "
                f"| {g.spread:.3f} | {round_errors[g.kind]:+.1%} |"
            )
        out.append(
            {
                "ttft_ms": ttft,
                "server_ttft_ms": server,
                "sim_ttft_ms": sim_ttft,
                "forwards": [dataclasses.asdict(g) for g in groups],
                "round_forwards": [dataclasses.asdict(g) for g in own_groups],
                # Every forward, so that a later fit can be set against these (simulator_refit.py).
                "records": [dataclasses.asdict(r) for r in replayed.records],
            }
        )
    return out


# A profile with forward noise is simulated once per seed, and each figure is the median over
# them: one draw of the forwards' times is one path, and under load which requests share a
# prefill can turn on a few milliseconds.
SEEDS = 9


def _simulations(
    config: Any, profile: HardwareProfile, trace: list[TraceRequest], limit: int, sched: dict[str, Any]
) -> list[Any]:
    seeds = range(SEEDS if profile.forward_noise else 1)
    return [simulate(config, profile, trace, limit, seed=seed, **sched) for seed in seeds]


def _settled_lines(trace_path: Path) -> int:
    """How many lines the trace has once the writer thread has caught up with the requests that
    returned (none added for a while; at most 30 s)."""
    count, still_since, deadline = -1, time.monotonic(), time.monotonic() + 30.0
    while time.monotonic() - still_since < 0.3 and time.monotonic() < deadline:
        now = len(trace_path.read_text().splitlines())
        if now != count:
            count, still_since = now, time.monotonic()
        time.sleep(0.05)
    return count


def _recorded(trace_path: Path, seen: int, count: int) -> list[str]:
    """The `count` lines recorded after the first `seen`. The server's writer thread appends them
    after the requests return: wait for them."""
    deadline = time.monotonic() + 30.0
    while True:
        lines = trace_path.read_text().splitlines()[seen:]
        if len(lines) >= count or time.monotonic() > deadline:
            return lines[:count]
        time.sleep(0.05)


def _since_first(lines: list[str], idle_s: float = 0.0) -> list[TraceRequest]:
    """Recorded requests, their arrivals from the first one's, which is at `idle_s`: how long the
    engine had idled before it (a simulation's device idles from its clock's 0)."""
    rows = load_trace_lines(lines)
    start = min(r.arrival_s for r in rows) - idle_s
    return [
        TraceRequest(
            r.arrival_s - start,
            r.input_ids,
            r.output_len,
            None if r.received_s is None else r.received_s - start,
            None if r.received_busy_s is None else r.received_busy_s - start,
        )
        for r in rows
    ]


if __name__ == "__main__":
    main()
