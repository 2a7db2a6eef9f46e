"""Validates `radixserve simulate` on this CPU: calibrate a profile on the calibration runs, then
predict W1, W2 and W3 (which the fit did not use) and compare with the measured runs.

    python benchmarks/simulator_validation.py [--work bench-work] [--repeats 3]

The model is the random SmolLM2-135M-shaped checkpoint of `radixserve bench offline` (bf16), on
one Engine with --max-total-tokens 40000. Throughput: each workload's total tokens over its wall
time (median of the repeats, cold cache), against the simulated makespan. TTFT: the same
prompts with one output token each, so that each request's latency is its time to first token
(the offline Engine reports no TTFT otherwise): the measured p50 against the simulated p50.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from radixserve.bench.model import ensure_random_smollm2
from radixserve.bench.workloads import make_workload, time_engine_runs
from radixserve.models.loader import load_model_config
from radixserve.runtime.engine import Engine
from radixserve.simulator.cli import calibrate_engine, scheduler_args
from radixserve.simulator.executor import SIM_VOCAB
from radixserve.simulator.simulate import simulate
from radixserve.simulator.trace import TraceRequest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("bench-work"))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = ensure_random_smollm2(args.work, "bfloat16")
    rows = []
    with Engine(str(model), dtype="bfloat16", max_total_tokens=40000, log_level="warning") as engine:
        profile, calibration = calibrate_engine(engine)
        print("| calibration run | measured s | predicted s |\n|---|---|---|")
        for run, predicted in calibration:
            label = f"{run.requests} x {run.prompt_len} + {run.output_len}"
            print(f"| {label} | {run.seconds:.3f} | {predicted:.3f} |")
        print(profile)
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
            sim = simulate(config, profile, trace, engine.max_total_tokens, **sched)
            predicted = total / sim.makespan_s
            # TTFT: the same prompts, one output token each.
            first = {"temperature": 0.0, "max_new_tokens": 1, "ignore_eos": True}
            ttfts = []
            for _ in range(args.repeats):
                engine.flush_cache()
                results = engine.generate(input_ids=workload.prompts, sampling_params=first)
                assert isinstance(results, list)
                ttfts.append(statistics.median(r["meta_info"]["e2e_latency"] for r in results) * 1000)
            one = [TraceRequest(0.0, r.input_ids, 1) for r in trace]
            sim_ttft = simulate(config, profile, one, engine.max_total_tokens, **sched).ttft_ms["p50"]
            rows.append((name, measured, predicted, statistics.median(ttfts), sim_ttft))
    print("| workload | measured tok/s | predicted | error | measured TTFT p50 ms | predicted | error |")
    print("|---|---|---|---|---|---|---|")
    for name, measured, predicted, ttft, sim_ttft in rows:
        print(
            f"| {name} | {measured:,.0f} | {predicted:,.0f} | {predicted / measured - 1:+.1%} "
            f"| {ttft:,.0f} | {sim_ttft:,.0f} | {sim_ttft / ttft - 1:+.1%} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
