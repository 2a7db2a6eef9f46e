"""W1/W2 with --tp-size 1 and 2 and the overlap schedule off and on (or, with --pp, --pp-size 1
and 2, and how busy the pipeline's stages were kept), and the scheduler's own time per step (a
pipeline's per tick), through the Engine on this machine.

    python benchmarks/scale_out.py [--work bench-work] [--repeats 3] [--pp]

SmolLM2-135M's 9 attention heads do not split over 2 ranks, so this runs a random model of the
same size and shape but 8 heads of 72 and 4 KV heads (written on first use to
WORK/smollm2-135m-8heads-random-bf16, from the tokenizer of `radixserve bench offline`'s model).
Total tok/s = (input + output tokens) / wall seconds, median of the repeats, cold cache each time;
ratios are against TP 1 with overlap off in the same run. "sched ms" is the scheduler's own time
per forward step (step time minus forward time, from get_stats); "fwd ms" the forward's.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from radixserve.runtime.engine import Engine
from radixserve_tools.bench.model import ensure_random_smollm2
from radixserve_tools.bench.workloads import make_workload, time_engine_runs

# (tp_size, pp_size, overlap)
SETUPS = [(1, 1, False), (1, 1, True), (2, 1, False), (2, 1, True)]
PP_SETUPS = [(1, 1, False), (1, 2, False)]
SHAPE = {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 72}


def ensure_tp_model(work: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    out = work / "smollm2-135m-8heads-random-bf16"
    if (out / "config.json").is_file():
        return out
    base = ensure_random_smollm2(work, "bfloat16")
    config = json.loads((base / "config.json").read_text())
    config.update(SHAPE)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**config), dtype=torch.float32)
    model.to(torch.bfloat16).save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    return out


def run(model: Path, tp_size: int, pp_size: int, overlap: bool, repeats: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    flag = "enable_overlap_schedule" if overlap else "disable_overlap_schedule"
    with Engine(
        str(model), dtype="bfloat16", tp_size=tp_size, pp_size=pp_size, max_total_tokens=40000,
        schedule_policy="lpm", log_level="warning", **{flag: True},
    ) as engine:  # fmt: skip
        for workload in (make_workload("W1"), make_workload("W2")):
            before = engine.get_stats()["pipeline"]
            runs = time_engine_runs(engine, workload, repeats)
            after = engine.get_stats()["pipeline"]
            steps = [r.delta("forward_steps") for r in runs]
            forward_s = [r.delta("forward_time_s") for r in runs]
            sched_s = [r.delta("step_time_s") - f for r, f in zip(runs, forward_s, strict=True)]
            results[workload.name] = {
                "tok_s": (workload.in_tokens + workload.out_tokens)
                / statistics.median(r.seconds for r in runs),
                "sched_ms": statistics.median(1000 * s / n for s, n in zip(sched_s, steps, strict=True)),
                "fwd_ms": statistics.median(1000 * f / n for f, n in zip(forward_s, steps, strict=True)),
            }
            if pp_size > 1:
                # The share of stage-ticks that had a micro-batch to run (scheduler/pipeline.py).
                busy = after["busy_stage_ticks"] - before["busy_stage_ticks"]
                results[workload.name]["busy"] = busy / ((after["ticks"] - before["ticks"]) * pp_size)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("bench-work"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pp", action="store_true", help="--pp-size 1 and 2 instead of the TP setups")
    args = parser.parse_args()
    model = ensure_tp_model(args.work)
    columns = "{:>9} {:>6} {:>8} {:>7} {:>5}"
    print(f"{'tp':>3} {'pp':>3} {'overlap':>8}  " + "  ".join(
        columns.format(f"{name} tok/s", "ratio", "sched ms", "fwd ms", "busy") for name in ("W1", "W2")
    ))  # fmt: skip
    baseline: dict[str, float] = {}
    for tp_size, pp_size, overlap in PP_SETUPS if args.pp else SETUPS:
        r = run(model, tp_size, pp_size, overlap, args.repeats)
        cells = []
        for name in ("W1", "W2"):
            baseline.setdefault(name, r[name]["tok_s"])
            w = r[name]
            ratio = w["tok_s"] / baseline[name]
            busy = f" {w['busy']:>5.0%}" if "busy" in w else " " * 6
            cells.append(f"{w['tok_s']:>9.0f} {ratio:>6.2f} {w['sched_ms']:>8.2f} {w['fwd_ms']:>7.1f}{busy}")
        print(f"{tp_size:>3} {pp_size:>3} {'on' if overlap else 'off':>8}  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
