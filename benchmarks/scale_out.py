"""W1/W2 with --tp-size 1 and 2 and the overlap schedule off and on, and the scheduler's own time
per step, through the Engine on this machine.

    python benchmarks/scale_out.py [--work bench-work] [--repeats 3]

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
import time
from pathlib import Path
from typing import Any

from radixserve.bench.model import ensure_random_smollm2
from radixserve.bench.workloads import make_workload
from radixserve.engine import Engine

SETUPS = [(1, False), (1, True), (2, False), (2, True)]
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


def run(model: Path, tp_size: int, overlap: bool, repeats: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    flag = "enable_overlap_schedule" if overlap else "disable_overlap_schedule"
    with Engine(
        str(model), dtype="bfloat16", tp_size=tp_size, max_total_tokens=40000, schedule_policy="lpm",
        log_level="warning", **{flag: True},
    ) as engine:  # fmt: skip
        for workload in (make_workload("W1"), make_workload("W2")):
            params = {"temperature": 0.0, "max_new_tokens": workload.max_new_tokens, "ignore_eos": True}
            engine.generate(
                input_ids=[p[:16] for p in workload.prompts], sampling_params={**params, "max_new_tokens": 2}
            )
            seconds, sched_ms, fwd_ms = [], [], []
            for _ in range(repeats):
                engine.flush_cache()
                before = engine.get_stats()
                start = time.perf_counter()
                engine.generate(input_ids=workload.prompts, sampling_params=params)
                seconds.append(time.perf_counter() - start)
                after = engine.get_stats()
                steps = after["forward_steps"] - before["forward_steps"]
                step_s = after["step_time_s"] - before["step_time_s"]
                forward_s = after["forward_time_s"] - before["forward_time_s"]
                sched_ms.append(1000 * (step_s - forward_s) / steps)
                fwd_ms.append(1000 * forward_s / steps)
            results[workload.name] = {
                "tok_s": (workload.in_tokens + workload.out_tokens) / statistics.median(seconds),
                "sched_ms": statistics.median(sched_ms),
                "fwd_ms": statistics.median(fwd_ms),
            }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("bench-work"))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = ensure_tp_model(args.work)
    print(f"{'tp':>3} {'overlap':>8}  {'W1 tok/s':>9} {'ratio':>6} {'sched ms':>8} {'fwd ms':>7}"
          f"  {'W2 tok/s':>9} {'ratio':>6} {'sched ms':>8} {'fwd ms':>7}")  # fmt: skip
    baseline: dict[str, float] = {}
    for tp_size, overlap in SETUPS:
        r = run(model, tp_size, overlap, args.repeats)
        cells = []
        for name in ("W1", "W2"):
            baseline.setdefault(name, r[name]["tok_s"])
            w = r[name]
            ratio = w["tok_s"] / baseline[name]
            cells.append(f"{w['tok_s']:>9.0f} {ratio:>6.2f} {w['sched_ms']:>8.2f} {w['fwd_ms']:>7.1f}")
        print(f"{tp_size:>3} {'on' if overlap else 'off':>8}  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
