"""Does a calibrated profile carry over to a model of another size? The profile that
simulator_validation.py fitted on the SmolLM2-shaped model predicts runs of another model (by
default random weights in Llama-3.2-1B's shape, eight times the weights) on the same machine,
which the fit never saw; each run is timed as calibration times its runs, and compared.

    python benchmarks/simulator_validation.py            # writes bench-work/simulator-validation.json
    python benchmarks/simulator_other_model.py [--work bench-work] [--passes 2] [--validation JSON]

A decode step reads every weight, so a profile that splits a decode step's time wrongly between
reading the weights and its fixed cost predicts a larger model's steps wrongly, though it
predicts the calibration model's exactly (docs/simulator.md). The decode step's own figure is
printed apart: the difference between a run with 16 output tokens and the same run with one,
per step.

The host's speed drifts by more than the errors sought (docs/simulator.md), so beside the other
model's passes the calibration model itself is timed again on a few of the validation's
calibration runs (REFERENCE), a pass before each of the other model's and one after the last.
Their times against the validation's give the host's speed now against then, printed with each
run's error with that ratio divided out: a diagnostic of how much of an error is the host's, not
a correction of the prediction. The rate the engine streams weights is measured again before and
after the passes too: it drifts apart from the compute those runs mostly show.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

from radixserve.executor.model_runner import pick_device
from radixserve.models.source import load_model_config
from radixserve.runtime.engine import Engine
from radixserve_tools.bench.model import ensure_random_llama_1b, ensure_random_smollm2
from radixserve_tools.simulator.calibrate import predicted_seconds, recorded_forwards
from radixserve_tools.simulator.calibration_passes import CalibrationShape, CalibrationTimer
from radixserve_tools.simulator.cli import scheduler_args
from radixserve_tools.simulator.hardware import HardwareProfile
from radixserve_tools.simulator.peaks import engine_linears, measure_decode_overlap, weights_bandwidth

# Prefill-bound and decode-bound runs, short enough for a 1B model on two cores (about 25 s a pass).
# The first and third differ by 15 decode steps of one request.
RUNS = (
    CalibrationShape(1, 64, 1),
    CalibrationShape(1, 256, 1),
    CalibrationShape(1, 64, 16),
    CalibrationShape(4, 64, 16),
    CalibrationShape(16, 64, 8),
    CalibrationShape(1, 64, 16, cached_prefix=512),
)
DECODE_STEPS = RUNS[2].output_len - RUNS[0].output_len
# The validation's calibration runs timed again on the calibration model (by their labels):
# prefills and decode steps, about 8 s a pass.
REFERENCE = ("1 x 64 + 1", "1 x 256 + 1", "1 x 64 + 48", "8 x 64 + 48")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("bench-work"))
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--max-total-tokens", type=int, default=40000)
    parser.add_argument("--validation", type=Path, help="its JSON (default: WORK/simulator-validation.json)")
    args = parser.parse_args()
    validation = json.loads((args.validation or args.work / "simulator-validation.json").read_text())
    profile = HardwareProfile.from_dict(validation["profile"])
    model = ensure_random_llama_1b(args.work)
    flags = {"dtype": "bfloat16", "max_total_tokens": args.max_total_tokens, "log_level": "warning"}
    then = {CalibrationShape.from_row(row).label: row for row in validation["calibration"]}
    reference_shapes = [CalibrationShape.from_row(then[label]) for label in REFERENCE]
    with (
        Engine(str(model), **flags) as engine,
        Engine(str(ensure_random_smollm2(args.work, "bfloat16")), **flags) as reference_engine,
    ):
        reference = CalibrationTimer.start(reference_engine, shapes=reference_shapes)
        timer = CalibrationTimer.start(engine, shapes=RUNS)
        rates = [_weights_rate(engine)]
        for _ in range(args.passes):
            reference.time_pass()
            timer.time_pass()
        reference.time_pass()
        rates.append(_weights_rate(engine))
        runs = timer.runs()
        config = load_model_config(engine.source)
        server_args = scheduler_args(engine.args, pick_device(engine.args.device).type)
        limit = engine.max_total_tokens
    now = {run.shape.label: run.seconds for run in reference.runs()}
    drift = statistics.median(now[label] / then[label]["measured_s"] for label in REFERENCE)
    print(
        "the calibration model's runs took "
        + ", ".join(f"{now[label] / then[label]['measured_s']:.2f}" for label in REFERENCE)
        + f" of their time in the validation: the host at x {drift:.2f} of its time then"
    )
    bandwidth = profile.memory_bandwidth * profile.bandwidth_efficiency
    print(f"profile: {profile.name}, the weights read at {bandwidth / 1e9:.1f} GB/s")
    # The weights' rate drifts apart from the compute the reference runs mostly show.
    before, after = (rate / 1e9 for rate in rates)
    print(f"the weights' rate now, before and after the passes: {before:.1f}, {after:.1f} GB/s")
    print("| run | measured s | predicted s | error | with the host's drift divided out |")
    print("|---|---|---|---|---|")
    rows = []
    for i, run in enumerate(runs):
        forwards = recorded_forwards(config, run.shape, i, limit, **server_args)
        predicted = predicted_seconds(config, profile, run.shape, forwards)
        shape = dataclasses.asdict(run.shape)
        rows.append(
            {"run": run.shape.label, "shape": shape, "measured_s": run.seconds, "predicted_s": predicted}
        )
        error = predicted / run.seconds - 1
        drifted = predicted * drift / run.seconds - 1
        print(f"| {run.shape.label} | {run.seconds:.3f} | {predicted:.3f} | {error:+.1%} | {drifted:+.1%} |")
    measured_step = (rows[2]["measured_s"] - rows[0]["measured_s"]) / DECODE_STEPS
    predicted_step = (rows[2]["predicted_s"] - rows[0]["predicted_s"]) / DECODE_STEPS
    print(
        f"a decode step of one request: measured {measured_step * 1e3:.1f} ms, predicted "
        f"{predicted_step * 1e3:.1f} ms ({predicted_step / measured_step - 1:+.1%})"
    )
    errors = [abs(r["predicted_s"] / r["measured_s"] - 1) for r in rows]
    print(f"median error {statistics.median(errors):.1%}")
    out = args.work / "simulator-other-model.json"
    record = {"profile": validation["profile"], "runs": rows, "host_drift": drift, "weights_rates": rates}
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")


def _weights_rate(engine: Engine) -> float:
    """The rate the engine's linear streams weights now, measured as calibrate measures it."""
    device = pick_device(engine.args.device)
    dtype, packing = engine_linears(engine.args, device)
    return weights_bandwidth(measure_decode_overlap(device, dtype=dtype, packing=packing), dtype)


if __name__ == "__main__":
    main()
