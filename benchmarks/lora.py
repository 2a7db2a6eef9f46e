"""W1 (32 requests x 256 prompt tokens, 64 output tokens) with 0, 1, 4 and 8 distinct LoRA adapters
in the batch (round robin over the requests), through one Engine with --max-loras-per-batch 8:
the cost of batched multi-LoRA against the base model, in the same run.

    python benchmarks/lora.py [--work bench-work] [--repeats 3] [--rank 16]

The model is the random SmolLM2-135M-shaped checkpoint of `radixserve bench offline` (bf16); the
adapters are random PEFT adapters of rank R on all seven projections, written under WORK on first
use. Total tok/s = (input + output tokens) / wall seconds, median of the repeats, cold cache each
time; the ratio is against the base model's. The engine with LoRA on runs the unfused decode path
(docs/lora.md), so the base model is also measured on an engine without --enable-lora.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from radixserve.runtime.engine import Engine
from radixserve_tools.bench.model import ensure_random_smollm2
from radixserve_tools.bench.workloads import make_workload, time_engine_runs

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def ensure_adapters(work: Path, model: Path, count: int, rank: int) -> list[Path]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = [work / f"smollm2-lora-r{rank}-{i}" for i in range(count)]
    for i, path in enumerate(paths):
        if (path / "adapter_model.safetensors").is_file():
            continue
        torch.manual_seed(100 + i)
        base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
        peft_model = get_peft_model(base, config)
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.data.mul_(0.01)  # a delta of a trained adapter's size, not a random matrix's
        peft_model.save_pretrained(path)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("bench-work"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    model = ensure_random_smollm2(args.work, "bfloat16")
    adapters = ensure_adapters(args.work, model, 8, args.rank)
    workload = make_workload("W1")
    total = workload.in_tokens + workload.out_tokens
    common = {"dtype": "bfloat16", "log_level": "warning", "max_total_tokens": 40000}
    rows: list[tuple[str, float]] = []
    with Engine(str(model), **common) as engine:
        runs = time_engine_runs(engine, workload, args.repeats)
        rows.append(("base model, LoRA off", total / statistics.median(r.seconds for r in runs)))
    paths = [f"l{i}={p}" for i, p in enumerate(adapters)]
    with Engine(str(model), lora_paths=paths, max_loras_per_batch=8, **common) as engine:
        for count in (0, 1, 4, 8):
            names = [None if count == 0 else f"l{i % count}" for i in range(len(workload.prompts))]
            runs = time_engine_runs(engine, workload, args.repeats, lora_path=names)
            rows.append((f"LoRA on, {count} adapters", total / statistics.median(r.seconds for r in runs)))
    base = rows[0][1]
    print(f"| setting (rank {args.rank}) | W1 total tok/s | vs base |\n|---|---|---|")
    for label, tok_s in rows:
        print(f"| {label} | {tok_s:,.0f} | {tok_s / base:.2f} |", flush=True)


if __name__ == "__main__":
    main()
