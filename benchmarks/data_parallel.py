"""W1/W2 through the Engine with --dp-size 1 and 2, and the prompt cache hit rate per routing method.

G3 is W2 with three prefix groups: 3 different 512-token prefixes, request i using prefix i % 3
(+ 32 unique tokens each, 32 output tokens); it shows what cache-aware routing keeps together
that round robin spreads over both replicas.

    python benchmarks/data_parallel.py [MODEL_DIR] [--repeats 3]

MODEL_DIR defaults to bench-work/smollm2-135m-random-bf16 (made by `radixserve bench offline`).
Total tok/s = (input + output tokens) / wall seconds, median of the repeats, cold cache each time.
On a CPU the replicas split the cores between them (each gets cores / dp_size torch threads).
"""

from __future__ import annotations

import argparse
import random
import statistics
from typing import Any

from radixserve.runtime.engine import Engine
from radixserve_tools.bench.workloads import Workload, make_workload, time_engine_runs

SETUPS = [(1, "round_robin"), (2, "round_robin"), (2, "shortest_queue"), (2, "cache_aware")]


def grouped_workload() -> Workload:
    rng = random.Random(4)
    prefixes = [[rng.randrange(100, 49000) for _ in range(512)] for _ in range(3)]
    prompts = [prefixes[i % 3] + [rng.randrange(100, 49000) for _ in range(32)] for i in range(32)]
    return Workload("G3", prompts, 32)


def run(model: str, dp_size: int, method: str, repeats: int) -> dict[str, Any]:
    results: dict[str, Any] = {"dp_size": dp_size, "method": method}
    with Engine(
        model, dtype="bfloat16", dp_size=dp_size, load_balance_method=method, max_total_tokens=40000,
        schedule_policy="lpm", log_level="warning",
    ) as engine:  # fmt: skip
        for workload in (make_workload("W1"), make_workload("W2"), grouped_workload()):
            runs = time_engine_runs(engine, workload, repeats)
            tokens = workload.in_tokens + workload.out_tokens
            results[workload.name] = {
                "tok_s": tokens / statistics.median(r.seconds for r in runs),
                "cache_hit": statistics.median(r.delta("cached_tokens") / workload.in_tokens for r in runs),
            }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="bench-work/smollm2-135m-random-bf16")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"{'dp':>3} {'routing':>15}  W1 tok/s  W2 tok/s  G3 tok/s  W2 cached  G3 cached")
    for dp_size, method in SETUPS:
        r = run(args.model, dp_size, method, args.repeats)
        w1, w2, g3 = r["W1"], r["W2"], r["G3"]
        speeds = f"{w1['tok_s']:>9.0f} {w2['tok_s']:>9.0f} {g3['tok_s']:>9.0f}"
        print(f"{dp_size:>3} {method:>15} {speeds} {w2['cache_hit']:>10.1%} {g3['cache_hit']:>10.1%}")


if __name__ == "__main__":
    main()
