"""Shared-prefix attention on SmolLM2-135M's head shape (9 query heads over 3 K/V heads, head_dim 64):
torch's CPU flash kernel (what the cascade ran without AMX before csrc/prefix_attention.cpp), the
vector kernel built for each ISA this CPU can run, and the AMX tile kernel where the CPU has it.

    .venv/bin/python benchmarks/prefix_attention.py [--cases 32x512,8x512,2x512,32x2048,512x512]

A case RxL is R query rows (decode requests, or an extend's new tokens) over L shared keys. Prints
µs per call (median of timed calls) with torch's threads.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from radixserve.attention.common import stack_by_kv_head
from radixserve.kernels.cpu_ops import CpuKernels
from radixserve.kernels.native import executable_isas, load_isa

sys.path.insert(0, str(Path(__file__).parent))
from linear_kernels import time_us

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def time_case(kernels: dict[str, CpuKernels], rows: int, length: int, seconds: float) -> dict[str, float]:
    """µs per call of each kernel for rows queries over length shared keys."""
    torch.manual_seed(0)
    q = torch.randn(rows, HEADS, HEAD_DIM, dtype=torch.bfloat16)
    keys, values = (torch.randn(length, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(2))
    scale = HEAD_DIM**-0.5
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

    def torch_flash() -> object:
        stacked = stack_by_kv_head(q, KV_HEADS)
        k, v = (x.transpose(0, 1).unsqueeze(0) for x in (keys, values))
        return flash(stacked, k, v, 0.0, False, scale=scale)

    def native(kernel: CpuKernels, name: str) -> float:
        return time_us(lambda: kernel.prefix_attention(q, keys, values, scale, name), seconds)

    results = {"torch flash": time_us(torch_flash, seconds)}
    for isa, kernel in kernels.items():
        results[f"vector {isa}"] = native(kernel, "vector")
    if kernels["native"].has_amx_linear:
        results["amx"] = native(kernels["native"], "amx")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cases", default="32x512,8x512,2x512,32x2048,512x512")
    parser.add_argument("--seconds", type=float, default=0.5)
    args = parser.parse_args()
    kernels = {isa: CpuKernels(load_isa(isa)) for isa in ["native", *executable_isas()]}
    print(f"torch threads {torch.get_num_threads()}")
    for case in args.cases.split(","):
        rows, length = (int(x) for x in case.split("x"))
        results = time_case(kernels, rows, length, args.seconds)
        row = "  ".join(f"{name} {us:9.1f}" for name, us in results.items())
        print(f"{rows:5d} rows x {length:5d} keys: {row}")


if __name__ == "__main__":
    main()
