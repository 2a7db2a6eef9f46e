"""`radixserve bench`: the offline throughput benchmark against a transformers baseline."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from radixserve.args import SCHEDULE_POLICIES
from radixserve.bench.workloads import parse_workload_names

_BENCH_DTYPES = ("bfloat16", "float32")


def _csv(choices: tuple[str, ...] | None = None) -> Any:
    def parse(spec: str) -> list[str]:
        items = [s.strip() for s in spec.split(",") if s.strip()]
        if not items:
            raise argparse.ArgumentTypeError("expected a comma-separated list")
        if choices is not None:
            bad = [s for s in items if s not in choices]
            if bad:
                raise argparse.ArgumentTypeError(f"{', '.join(bad)} not in {', '.join(choices)}")
        return items

    return parse


def _workloads(spec: str) -> list[str]:
    try:
        return parse_workload_names(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _scale(spec: str) -> float:
    value = float(spec)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"--scale must be in (0, 1], got {spec}")
    return value


def _positive_int(spec: str) -> int:
    value = int(spec)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {spec}")
    return value


def _bench(args: argparse.Namespace) -> int:
    from radixserve.bench.offline import BenchConfig, format_table, run_benchmark, write_report

    cfg = BenchConfig(
        workloads=args.workloads,
        dtypes=args.dtypes,
        repeats=args.repeats,
        hf_batch=args.hf_batch,
        baseline=not args.no_baseline,
        work_dir=Path(args.work_dir),
        model_path=args.model_path,
        scale=args.scale,
        max_total_tokens=args.max_total_tokens,
        schedule_policy=args.schedule_policy,
    )
    report = run_benchmark(cfg, log=lambda line: print(line, flush=True))
    print()
    print(format_table(report["comparisons"]))
    if args.out:
        write_report(report, Path(args.out))
        print(f"\nwrote {args.out}")
    return 0


def add_bench_parser(sub: Any) -> argparse.ArgumentParser:
    """Register `bench` on the top-level subparsers object."""
    bench = sub.add_parser(
        "bench",
        help="offline throughput benchmark (W1/W2/W3) against a transformers static-batch baseline",
        description=(
            "Runs the peers' token-id workloads on radixserve and on transformers `generate` in one "
            "process and prints total tok/s and the ratio radixserve/transformers. By default the model "
            "is a random-weight SmolLM2-135M built (once) under --work-dir."
        ),
    )
    bench.add_argument(
        "--workloads", type=_workloads, default=["W1", "W2", "W3"], help="comma list (default W1,W2,W3)"
    )
    bench.add_argument(
        "--dtypes",
        type=_csv(_BENCH_DTYPES),
        default=["bfloat16", "float32"],
        help="comma list of bfloat16,float32 (default both)",
    )
    bench.add_argument("--repeats", type=_positive_int, default=3, help="timed runs per result; median")
    bench.add_argument("--hf-batch", type=_positive_int, default=32, help="transformers static batch size")
    bench.add_argument("--no-baseline", action="store_true", help="skip the transformers baseline")
    bench.add_argument("--work-dir", default="bench-work", help="where the random model is written")
    bench.add_argument("--out", default=None, help="write the full report as JSON here")
    bench.add_argument(
        "--scale",
        type=_scale,
        default=1.0,
        help="shrink request counts and lengths (0 < s <= 1) for smoke runs",
    )
    bench.add_argument(
        "--model-path",
        default=None,
        help="benchmark this model instead ('default' = packaged SmolLM2 GGUF); the baseline runs "
        "only for transformers directories",
    )
    bench.add_argument(
        "--max-total-tokens",
        type=_positive_int,
        default=None,
        help="KV pool size (default: fits the workload)",
    )
    bench.add_argument(
        "--schedule-policy", default="lpm", choices=SCHEDULE_POLICIES, help="radixserve policy (default lpm)"
    )
    bench.set_defaults(func=_bench)
    return bench
