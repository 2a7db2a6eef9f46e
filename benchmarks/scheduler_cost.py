"""What the scheduler itself spends per decode step (policy ordering, radix matching, batch
building, output processing), with a zero-cost executor, at 64, 256 and 1,024 running requests,
with and without 1,000 more waiting (held back by --max-running-requests, so every step orders
and tries them).

    python benchmarks/scheduler_cost.py [--steps 100] [--config CONFIG_JSON_OR_BUILT_IN_NAME]

Host time per scheduler.step() (median and p90 over --steps decode steps, after every running
request has finished its prefill); the model is only a shape here (default: Llama-3.1-8B's).
"""

from __future__ import annotations

import argparse
import statistics
import time

from radixserve.config.server_args import ServerArgs
from radixserve.models.config import ModelConfig
from radixserve.protocol.messages import GenerateRequest
from radixserve.protocol.sampling_params import SamplingParams
from radixserve.scheduler.scheduler import Scheduler
from radixserve_tools.simulator.executor import CostModelExecutor
from radixserve_tools.simulator.model_configs import load_config
from radixserve_tools.simulator.trace import SyntheticTrace, synthetic


def step_times(config: ModelConfig, running: int, waiting: int, steps: int) -> list[float]:
    # Room for every request's whole output: admission reserves it, and all must run at once.
    executor = CostModelExecutor(
        config, max_total_tokens=(running + waiting) * (128 + 4096) + 4096, profile=None
    )
    args = ServerArgs(log_level="warning", max_running_requests=running, schedule_policy="lpm")
    scheduler = Scheduler(args, executor)
    trace = synthetic(
        SyntheticTrace(num_requests=running + waiting, input_len=(128, 128), output_len=(4096, 4096))
    )
    for i, req in enumerate(trace):
        params = {"max_new_tokens": req.output_len, "ignore_eos": True, "temperature": 0.0}
        scheduler.handle(GenerateRequest(f"r{i}", req.input_ids, SamplingParams.from_dict(params)))
    while len(scheduler.queues.running) < running or scheduler.queues.chunked_req is not None:
        scheduler.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        scheduler.step()
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--config", default="llama-3.1-8b", help="as simulate's --model-config")
    args = parser.parse_args()
    config = load_config(args.config)
    print("| running | waiting | step ms, median | p90 |\n|---|---|---|---|")
    for running in (64, 256, 1024):
        for waiting in (0, 1000):
            times = sorted(step_times(config, running, waiting, args.steps))
            median, p90 = statistics.median(times), times[int(0.9 * len(times))]
            print(f"| {running} | {waiting} | {median * 1000:.2f} | {p90 * 1000:.2f} |", flush=True)


if __name__ == "__main__":
    main()
