"""Validates `radixserve simulate` on this machine: calibrate a profile on the calibration runs, then
predict W1, W2 and W3 (which the fit did not use) and compare with the measured runs.

    python benchmarks/simulator_validation.py [--work bench-work] [--repeats 3]
    python benchmarks/simulator_validation.py --device cuda --model llama-1b --hardware H200

The model is the random SmolLM2-135M-shaped checkpoint of `radixserve bench offline` (bf16), or
with --model llama-1b random weights in Llama-3.2-1B's shape, on one Engine with
--max-total-tokens 40000. With --hardware, the same workloads are also predicted from that
built-in profile as published (its default efficiencies, no calibration).

Throughput: each workload's total tokens over its wall time (median of the repeats, cold cache),
against the simulated makespan. TTFT: the same prompts with one output token each, so that each
request's latency is its time to first token (the offline Engine reports no TTFT otherwise): the
measured p50 against the simulated p50.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from radixserve.bench.model import ensure_random_llama_1b, ensure_random_smollm2
from radixserve.bench.workloads import make_workload, time_engine_runs
from radixserve.executor.model_runner import pick_device
from radixserve.models.loader import load_model_config
from radixserve.runtime.engine import Engine
from radixserve.simulator.cli import calibrate_engine, scheduler_args
from radixserve.simulator.executor import SIM_VOCAB
from radixserve.simulator.hardware import HardwareProfile, load_profile
from radixserve.simulator.simulate import simulate
from radixserve.simulator.trace import TraceRequest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("bench-work"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--model", choices=("smollm2-135m", "llama-1b"), default="smollm2-135m")
    parser.add_argument("--max-total-tokens", type=int, default=40000)
    parser.add_argument("--hardware", default=None, help="also predict from this built-in profile")
    args = parser.parse_args()
    device = pick_device(args.device)
    if args.model == "llama-1b":
        model = ensure_random_llama_1b(args.work, build_device=device.type)
    else:
        model = ensure_random_smollm2(args.work, "bfloat16")
    flags = {"dtype": "bfloat16", "device": args.device, "max_total_tokens": args.max_total_tokens}
    profiles: list[tuple[str, HardwareProfile]] = []
    rows = []
    with Engine(str(model), **flags, log_level="warning") as engine:
        calibrated, calibration = calibrate_engine(engine, name=f"calibrated-{device.type}")
        print("| calibration run | measured s | predicted s |\n|---|---|---|")
        for run, predicted in calibration:
            label = f"{run.requests} x {run.prompt_len} + {run.output_len}"
            print(f"| {label} | {run.seconds:.3f} | {predicted:.3f} |")
        print(calibrated)
        profiles.append(("calibrated", calibrated))
        if args.hardware:
            profiles.append((args.hardware, load_profile(args.hardware)))
        config = load_model_config(engine.source)
        sched = scheduler_args(engine.args)
        for name in ("W1", "W2", "W3"):
            workload = make_workload(name)
            total = workload.in_tokens + workload.out_tokens
            measured = total / statistics.median(
                r.seconds for r in time_engine_runs(engine, workload, args.repeats)
            )
            trace = [
                TraceRequest(0.0, [t % SIM_VOCAB for t in p], workload.max_new_tokens)
                for p in workload.prompts
            ]
            # TTFT: the same prompts, one output token each.
            first = {"temperature": 0.0, "max_new_tokens": 1, "ignore_eos": True}
            ttfts = []
            for _ in range(args.repeats):
                engine.flush_cache()
                results = engine.generate(input_ids=workload.prompts, sampling_params=first)
                assert isinstance(results, list)
                ttfts.append(statistics.median(r["meta_info"]["e2e_latency"] for r in results) * 1000)
            one = [TraceRequest(0.0, r.input_ids, 1) for r in trace]
            for label, profile in profiles:
                sim = simulate(config, profile, trace, engine.max_total_tokens, **sched)
                sim_ttft = simulate(config, profile, one, engine.max_total_tokens, **sched).ttft_ms["p50"]
                rows.append(
                    (name, label, measured, total / sim.makespan_s, statistics.median(ttfts), sim_ttft)
                )
    columns = (
        "workload | profile | measured tok/s | predicted | error | measured TTFT p50 ms | predicted | error"
    )
    print(f"| {columns} | error |")
    print("|---|---|---|---|---|---|---|---|")
    for name, label, measured, predicted, ttft, sim_ttft in rows:
        print(
            f"| {name} | {label} | {measured:,.0f} | {predicted:,.0f} | {predicted / measured - 1:+.1%} "
            f"| {ttft:,.1f} | {sim_ttft:,.1f} | {sim_ttft / ttft - 1:+.1%} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
