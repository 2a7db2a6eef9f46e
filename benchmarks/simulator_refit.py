"""Fit a profile again on measurements a validation saved, with the code as it is now: another
fit or cost model tried on the same runs without timing them again (they take 10-20 minutes and
the host drifts between runs). Prints the calibration runs' errors, the fitted figures and, with
--other-model, the errors on the other model's runs that simulator_other_model.py saved.

    python benchmarks/simulator_refit.py bench-work/simulator-validation.json \\
        [--other-model bench-work/simulator-other-model.json] [--passes 1,2] [--row-cost fit|SECONDS]

What calibrate measured (peaks, bandwidth, the linears' rates, the pointwise costs) is taken from
the saved profile; what the fit fills in is fitted again. A validation that kept its replays'
forwards has each set against the new fit (the fit never saw them). With --passes, the fit takes
those calibration passes only: a replay's neighbours, say, apart from the host's drift over the
rest (and the peaks measured after those passes, where the validation kept them). The cost per row
is held where the validation's engine measured its scheduler's own (fitted where the save lacks
it); --row-cost fits it, or holds it at the seconds given. A validation that kept every workload
run's arrivals has the new fit predict W1-W3 again from them. The models are the validation's (its
--model) and the other-model run's random-weight models in WORK.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
from pathlib import Path
from typing import Any

import torch
from simulator_validation import load_workloads, print_rows, workload_rows

from radixserve.config.server_args import ServerArgs
from radixserve.models.config import ModelConfig
from radixserve.models.source import load_model_config, resolve_model_source
from radixserve_tools.bench.model import ensure_random_llama_1b, ensure_random_smollm2
from radixserve_tools.simulator.calibrate import fit, predicted_seconds, recorded_forwards
from radixserve_tools.simulator.calibration_passes import CalibrationShape, Run, timed_runs
from radixserve_tools.simulator.cli import _describe, held_row_cost, scheduler_args
from radixserve_tools.simulator.executor import ForwardRecord
from radixserve_tools.simulator.hardware import HardwareProfile
from radixserve_tools.simulator.peaks import median_measurements
from radixserve_tools.simulator.replay import ForwardGroup, compare_forwards, decode_host_time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("validation", type=Path, help="a JSON simulator_validation.py wrote")
    parser.add_argument("--other-model", type=Path, help="a JSON simulator_other_model.py wrote")
    parser.add_argument("--work", type=Path, default=Path("bench-work"))
    parser.add_argument("--max-total-tokens", type=int, default=40000)
    parser.add_argument(
        "--passes", help="fit on these calibration passes only (comma-separated, from 0), e.g. a round's"
    )
    parser.add_argument(
        "--row-cost",
        help="'fit', or seconds per sampled row to hold (default: what the validation's engine measured)",
    )
    args = parser.parse_args()
    saved = json.loads(args.validation.read_text())
    # Fields this code no longer has (an older profile's) are left out.
    fields = {
        k: v
        for k, v in saved["profile"].items()
        if k in {f.name for f in dataclasses.fields(HardwareProfile)}
    }
    saved_profile = HardwareProfile.from_dict(fields)
    # The validation's model (older saves lack it: the SmolLM2 shape).
    llama = saved.get("model") == "llama-1b"
    model = ensure_random_llama_1b(args.work) if llama else ensure_random_smollm2(args.work, "bfloat16")
    config, sched = _model(model, args.max_total_tokens)
    shapes = [CalibrationShape.from_row(row) for row in saved["calibration"]]
    measured = saved_profile.measured()
    if args.passes:
        passes = [int(k) for k in args.passes.split(",")]
        runs = timed_runs(shapes, saved["pass_samples"], passes)
        if "peak_samples" in saved:  # the peaks measured after each of those passes
            samples = [HardwareProfile.from_dict(saved["peak_samples"][k]) for k in passes]
            measured = median_measurements(samples, torch.bfloat16)
    else:
        pairs = zip(shapes, saved["calibration"], strict=True)
        runs = [Run(shape, r["measured_s"], r["log_squares"], r["log_df"]) for shape, r in pairs]
    # The shapes as the validation timed them (already cut to the model's context).
    recorded = [
        recorded_forwards(config, run.shape, i, args.max_total_tokens, **sched) for i, run in enumerate(runs)
    ]
    row_cost = _row_cost(saved, args.row_cost)
    print("cost per row:", "fitted" if row_cost is None else f"held at {row_cost * 1e6:.1f} us")
    profile = fit(config, runs, recorded, measured, saved_profile.cascade_attention, row_cost)
    print("| calibration run | measured s | predicted s | error |\n|---|---|---|---|")
    logs = []
    for run, forwards in zip(runs, recorded, strict=True):
        predicted = predicted_seconds(config, profile, run.shape, forwards)
        error = predicted / run.seconds - 1
        print(f"| {run.shape.label} | {run.seconds:.3f} | {predicted:.3f} | {error:+.1%} |")
        if not run.shape.idle_s:
            logs.append(math.log(predicted / run.seconds))
    print(f"rms log error {math.sqrt(statistics.fmean(x * x for x in logs)):.4f}")
    print(_describe(profile))
    for i, replayed in enumerate(saved.get("replays", [])):
        if "records" in replayed:  # the replays' forwards, where kept
            records = [ForwardRecord.from_dict(r) for r in replayed["records"]]
            _print_forwards(f"serving run {i}'s replay", compare_forwards(records, config, profile))
            if (host := decode_host_time(records)) is not None:
                print(host.describe(profile))
    if "workload_runs" in saved:  # every workload run's arrivals, where kept
        workloads = load_workloads(saved["workload_runs"])
        rounds = 1 + max(k for entry in workloads.values() for _, k in entry.timed_runs + entry.ttft_runs)
        refit = [("refit", [profile] * rounds)]
        print_rows(workload_rows(workloads, refit, config, args.max_total_tokens, sched))
    if args.other_model:
        _other_model(json.loads(args.other_model.read_text()), profile, args)


def _other_model(saved: dict[str, Any], profile: HardwareProfile, args: argparse.Namespace) -> None:
    config, sched = _model(ensure_random_llama_1b(args.work), args.max_total_tokens)
    print("| other model's run | measured s | predicted s | error |\n|---|---|---|---|")
    for i, row in enumerate(saved["runs"]):
        if "shape" not in row:  # an older save
            raise SystemExit(
                f"{args.other_model} has no run shapes: time it again with simulator_other_model.py"
            )
        shape = CalibrationShape.from_row(row["shape"])
        forwards = recorded_forwards(config, shape, i, args.max_total_tokens, **sched)
        predicted = predicted_seconds(config, profile, shape, forwards)
        error = predicted / row["measured_s"] - 1
        print(f"| {shape.label} | {row['measured_s']:.3f} | {predicted:.3f} | {error:+.1%} |")


def _row_cost(saved: dict[str, Any], given: str | None) -> float | None:
    """The row cost to hold: `given` ('fit': none), else what the validation's engine measured of
    its scheduler (cli.held_row_cost), if it was saved."""
    if given is not None:
        return None if given == "fit" else float(given)
    return held_row_cost(saved.get("decode_host_time", {}))


def _print_forwards(title: str, groups: list[ForwardGroup]) -> None:
    print(f"| {title}: forwards | count | measured s | predicted s | error |\n|---|---|---|---|---|")
    for g in groups:
        print(f"| {g.kind} | {g.count} | {g.measured_s:.3f} | {g.predicted_s:.3f} | {g.error:+.1%} |")


def _model(path: Path, max_total_tokens: int) -> tuple[ModelConfig, dict[str, Any]]:
    args = ServerArgs(model_path=str(path), dtype="bfloat16", max_total_tokens=max_total_tokens)
    # The runs it refits were timed on this machine's CPU.
    return load_model_config(resolve_model_source(str(path))), scheduler_args(args, "cpu")


if __name__ == "__main__":
    main()
