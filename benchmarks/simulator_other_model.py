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
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

from radixserve.bench.model import ensure_random_llama_1b
from radixserve.models.loader import load_model_config
from radixserve.runtime.engine import Engine
from radixserve.simulator.calibrate import (
    CalibrationShape,
    CalibrationTimer,
    predicted_seconds,
    recorded_forwards,
)
from radixserve.simulator.cli import scheduler_args
from radixserve.simulator.hardware import HardwareProfile

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
    with Engine(str(model), **flags) as engine:
        timer = CalibrationTimer.start(engine, shapes=RUNS)
        for _ in range(args.passes):
            timer.time_pass()
        runs = timer.runs()
        config = load_model_config(engine.source)
        server_args = scheduler_args(engine.args)
        limit = engine.max_total_tokens
    bandwidth = profile.memory_bandwidth * profile.bandwidth_efficiency
    print(f"profile: {profile.name}, the weights read at {bandwidth / 1e9:.1f} GB/s")
    print("| run | measured s | predicted s | error |\n|---|---|---|---|")
    rows = []
    for i, run in enumerate(runs):
        forwards = recorded_forwards(config, run.shape, i, limit, **server_args)
        predicted = predicted_seconds(config, profile, run.shape, forwards)
        shape = dataclasses.asdict(run.shape)
        rows.append(
            {"run": run.shape.label, "shape": shape, "measured_s": run.seconds, "predicted_s": predicted}
        )
        error = predicted / run.seconds - 1
        print(f"| {run.shape.label} | {run.seconds:.3f} | {predicted:.3f} | {error:+.1%} |")
    measured_step = (rows[2]["measured_s"] - rows[0]["measured_s"]) / DECODE_STEPS
    predicted_step = (rows[2]["predicted_s"] - rows[0]["predicted_s"]) / DECODE_STEPS
    print(
        f"a decode step of one request: measured {measured_step * 1e3:.1f} ms, predicted "
        f"{predicted_step * 1e3:.1f} ms ({predicted_step / measured_step - 1:+.1%})"
    )
    errors = [abs(r["predicted_s"] / r["measured_s"] - 1) for r in rows]
    print(f"median error {statistics.median(errors):.1%}")
    out = args.work / "simulator-other-model.json"
    out.write_text(json.dumps({"profile": validation["profile"], "runs": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
