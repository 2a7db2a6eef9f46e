"""Where a decode step's time goes on a CUDA device (run by gpu_check.sh; see benchmarks/README.md).

Prints each single-stream run's end-to-end time for a few prompt and output lengths (a decode step
is the difference of two runs over the difference of their outputs), then profiles decode steps
of a single stream with the scheduler's torch profiler (/start_profile) and summarises the trace:
wall time per step against CUDA kernel time per step, and the CPU operators and kernels that take
the most. The traces are written gzipped beside the summary.

With --multiturn, it profiles `bench multiturn`'s workload instead, once with the radix cache alone
and once with L2 (the host pool): steps in the middle of the run, when returning turns load their
prefixes from host memory. The summaries add the CUDA runtime calls (copies, pinned allocations,
synchronisations) by time, where L2's cost beside a GPU would show.

Usage: python benchmarks/gpu_step_profile.py --work DIR --out DIR [--device cuda] [--multiturn]
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import shutil
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from radixserve.runtime.engine import Engine
from radixserve_tools.bench.model import ensure_random_llama_1b
from radixserve_tools.bench.multiturn import SMOLLM2_TOKEN_IDS, MultiTurnWorkload, run_turns

GREEDY = {"temperature": 0.0, "ignore_eos": True}
RUNS = ((64, 48), (64, 176), (128, 32), (128, 128), (512, 32), (512, 128))
PROFILED_STEPS = 24
MULTITURN_STEPS = 60


def _summary(trace_path: Path, steps: int) -> dict[str, Any]:
    events = [e for e in json.loads(trace_path.read_text())["traceEvents"] if e.get("ph") == "X"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    cpu_ops = [e for e in events if e.get("cat") == "cpu_op"]
    by_call: Counter[str] = Counter()
    for e in events:
        if e.get("cat") == "cuda_runtime":
            by_call[e["name"]] += e["dur"]
    start = min(e["ts"] for e in events)
    end = max(e["ts"] + e["dur"] for e in events)
    by_kernel: Counter[str] = Counter()
    for e in kernels:
        by_kernel[e["name"][:80]] += e["dur"]
    by_op: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    for e in cpu_ops:
        by_op[e["name"]] += e["dur"]
        calls[e["name"]] += 1
    return {
        "steps": steps,
        "wall_ms_per_step": (end - start) / 1e3 / steps,
        "kernel_ms_per_step": sum(e["dur"] for e in kernels) / 1e3 / steps,
        "kernels_per_step": len(kernels) / steps,
        "cpu_ops_per_step": len(cpu_ops) / steps,
        "top_kernels_ms_per_step": {k: v / 1e3 / steps for k, v in by_kernel.most_common(12)},
        "top_cuda_runtime_ms_per_step": {k: v / 1e3 / steps for k, v in by_call.most_common(10)},
        "top_cpu_ops_ms_per_step (inclusive)": {
            k: (v / 1e3 / steps, calls[k] / steps) for k, v in by_op.most_common(25)
        },
    }


def _gzip_traces(where: Path) -> None:
    for trace in where.glob("*.json"):
        with trace.open("rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        trace.unlink()


def _profile_single_stream(model: Path, device: str, out: Path) -> None:
    prompt = [7 + i % 900 for i in range(512)]
    with Engine(str(model), dtype="bfloat16", device=device, log_level="warning") as engine:
        engine.generate(input_ids=[prompt[:16]], sampling_params={**GREEDY, "max_new_tokens": 8})
        print("| prompt | output | e2e s | per output token ms |\n|---|---|---|---|")
        for prompt_len, out_len in RUNS:
            engine.flush_cache()
            results = engine.generate(
                input_ids=[prompt[:prompt_len]], sampling_params={**GREEDY, "max_new_tokens": out_len}
            )
            assert isinstance(results, list)
            e2e = results[0]["meta_info"]["e2e_latency"]
            print(f"| {prompt_len} | {out_len} | {e2e:.3f} | {e2e / out_len * 1e3:.1f} |", flush=True)
        engine.flush_cache()
        # A long single-stream generation; the profiler starts once it is decoding, and stops by
        # itself after PROFILED_STEPS steps.
        running = threading.Thread(
            target=engine.generate,
            kwargs={"input_ids": [prompt[:128]], "sampling_params": {**GREEDY, "max_new_tokens": 400}},
        )
        running.start()
        time.sleep(1.0)
        _start_profile(engine, out / "traces", PROFILED_STEPS)
        running.join()
    _summarise(out / "traces", out / "decode_profile_summary.json", PROFILED_STEPS)


def _profile_multiturn(model: Path, device: str, out: Path, context_tokens: int, after_s: float) -> None:
    workload = MultiTurnWorkload(context_tokens=context_tokens, concurrency=8)
    pool = workload.pool_conversations * workload.conversation_tokens
    for label, flags in (("off", {}), ("host", {"enable_hierarchical_cache": True, "hicache_ratio": 10.0})):
        with Engine(
            str(model), dtype="bfloat16", device=device, log_level="warning", max_total_tokens=pool, **flags
        ) as engine:
            messages = workload.messages(min(SMOLLM2_TOKEN_IDS, engine.vocab_size))
            running = threading.Thread(target=asyncio.run, args=(run_turns(engine, workload, messages),))
            running.start()
            time.sleep(after_s)  # past the first turns, which have nothing cached
            _start_profile(engine, out / label, MULTITURN_STEPS)
            running.join()
            engine.control("stop_profile")  # writes what it has if the run ended first (else a no)
            print(f"{label}: {engine.get_stats().get('hicache_host_pages_loaded', 0)} L2 pages loaded")
        _summarise(out / label, out / f"multiturn_{label}_profile_summary.json", MULTITURN_STEPS)


def _start_profile(engine: Engine, where: Path, steps: int) -> None:
    started = engine.control("start_profile", args={"output_dir": str(where), "num_steps": steps})
    assert started.ok, started.error


def _summarise(where: Path, summary_path: Path, steps: int) -> None:
    traces = sorted(where.glob("*.json"))
    if not traces:
        print(f"no trace was written in {where}")
        return
    summary = _summary(traces[-1], steps)
    print(summary_path.name, json.dumps(summary, indent=1))
    summary_path.write_text(json.dumps(summary, indent=1))
    _gzip_traces(where)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model-path", type=Path, help="default: random weights in Llama-3.2-1B's shape")
    parser.add_argument("--multiturn", action="store_true", help="profile bench multiturn, off and L2")
    parser.add_argument("--context-tokens", type=int, default=512, help="--multiturn's context per chat")
    parser.add_argument("--profile-after", type=float, default=6.0, help="--multiturn: seconds in")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.model_path or ensure_random_llama_1b(args.work, args.device)
    if args.multiturn:
        _profile_multiturn(model, args.device, args.out, args.context_tokens, args.profile_after)
    else:
        _profile_single_stream(model, args.device, args.out)


if __name__ == "__main__":
    main()
