"""What an open dashboard costs a busy server: W1 throughput through one Engine with
--enable-dashboard, with a viewer's snapshots (every 0.5 s, as /dashboard/events sends them)
being built, and without, alternated so that drift hits both alike.

    python benchmarks/dashboard_cost.py [--work bench-work] [--repeats 4]
"""

from __future__ import annotations

import argparse
import statistics
import threading
from pathlib import Path

from radixserve.runtime.engine import Engine
from radixserve.server.dashboard import UPDATE_INTERVAL_S, DashboardFeed
from radixserve_tools.bench.model import ensure_random_smollm2
from radixserve_tools.bench.workloads import make_workload, time_engine_runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("bench-work"))
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    model = ensure_random_smollm2(args.work, "bfloat16")
    workload = make_workload("W1")
    total = workload.in_tokens + workload.out_tokens
    rates: dict[str, list[float]] = {"closed": [], "open": []}
    flags = {"dtype": "bfloat16", "max_total_tokens": 40000, "log_level": "warning", "enable_dashboard": True}
    with Engine(str(model), **flags) as engine:
        feed = DashboardFeed(engine)
        for _ in range(args.repeats):
            for state in ("closed", "open"):
                stop = threading.Event()

                def view(stop: threading.Event = stop) -> None:
                    while not stop.wait(UPDATE_INTERVAL_S):
                        feed.build()

                viewer = threading.Thread(target=view, daemon=True)
                if state == "open":
                    viewer.start()
                (run,) = time_engine_runs(engine, workload, 1)
                stop.set()
                if state == "open":
                    viewer.join()
                rates[state].append(total / run.seconds)
    closed, opened = statistics.median(rates["closed"]), statistics.median(rates["open"])
    print("| W1 total tok/s | dashboard closed | dashboard open | ratio |\n|---|---|---|---|")
    print(f"| median of {args.repeats} | {closed:,.0f} | {opened:,.0f} | {opened / closed:.3f} |")
    print("runs:", {k: [round(v) for v in vs] for k, vs in rates.items()})


if __name__ == "__main__":
    main()
