"""bf16 linear kernels on SmolLM2-135M's shapes: oneDNN (where it packs bf16), F.linear, and the
native kernel of each ISA this CPU can run (csrc/bf16_linear.cpp, or the AMX matmul natively).

    .venv/bin/python benchmarks/linear_kernels.py [--rows 1,8,32,256,1024] [--seconds 0.3]

Prints µs per call (median of timed batches) and, at 1 row, the weight bytes streamed per second.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from radixserve.kernels.cpu_ops import CpuKernels
from radixserve.kernels.native import executable_isas, load_isa
from radixserve.layers.packed_weights import onednn_linear, onednn_packs_bf16

# (name, out_features, in_features)
SHAPES = [
    ("qkv", 960, 576),
    ("o", 576, 576),
    ("gate_up", 3072, 576),
    ("down", 576, 1536),
    ("lm_head", 49152, 576),
]


def time_us(fn: Callable[[], object], seconds: float) -> float:
    fn()
    samples = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(samples) < 5:
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="1,8,32,256,1024")
    parser.add_argument("--seconds", type=float, default=0.3)
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    kernels = {isa: CpuKernels(load_isa(isa)) for isa in ["native", *executable_isas()]}
    print(f"torch threads {torch.get_num_threads()}; oneDNN packs bf16: {onednn_packs_bf16()}")
    for name, n, k in SHAPES:
        torch.manual_seed(0)
        weight = torch.randn(n, k, dtype=torch.bfloat16) / k**0.5
        candidates: dict[str, Callable[[torch.Tensor], object]] = {"F.linear": partial(_plain, weight)}
        if onednn_packs_bf16():
            onednn = torch.ops.mkldnn._reorder_linear_weight(weight, None)
            candidates["onednn"] = partial(_onednn, onednn)
        for isa, kernel in kernels.items():
            packed = kernel.pack_linear(weight)
            if packed is not None:
                candidates[f"{kernel.linear_kernel} ({isa} build)"] = partial(_native, kernel, packed)
        for m in rows:
            x = torch.randn(m, k, dtype=torch.bfloat16)
            for label, fn in candidates.items():
                us = time_us(partial(fn, x), args.seconds)
                stream = f"  {n * k * 2 / us / 1e3:6.1f} GB/s of weights" if m == 1 else ""
                print(f"{name:8s} {n:5d}x{k:<5d} rows {m:5d} {label:34s} {us:10.1f} us{stream}")


def _plain(weight: torch.Tensor, x: torch.Tensor) -> object:
    return F.linear(x, weight)


def _onednn(packed: torch.Tensor, x: torch.Tensor) -> object:
    return onednn_linear(x, packed, None)


def _native(kernels: CpuKernels, packed: torch.Tensor, x: torch.Tensor) -> object:
    return kernels.linear(x, packed)


if __name__ == "__main__":
    main()
