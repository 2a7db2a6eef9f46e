"""STREAM-like read bandwidth: the sum of a buffer far larger than the last-level cache, on the
torch threads (2 on the development machine), in GB/s. Decode streams every weight once per step,
so this is the ceiling a decode step's weight traffic is compared against (docs/architecture.md).

    .venv/bin/python benchmarks/memory_bandwidth.py [--sizes-mb 256,512,1024] [--repeats 10]

An fp32 sum: torch's reduction of it is vectorized and keeps up with memory. (A bf16 sum is not a
memory measurement here: on an AVX2-only CPU torch reduces bf16 at ~1 GB/s, compute bound.)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def read_gbps(buffer: torch.Tensor, repeats: int) -> float:
    buffer.sum(dtype=torch.float32)  # page in
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum(dtype=torch.float32)
        times.append(time.perf_counter() - start)
    return buffer.numel() * buffer.element_size() / statistics.median(times) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes-mb", default="256,512,1024")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    print(f"torch threads {torch.get_num_threads()}")
    for megabytes in (int(s) for s in args.sizes_mb.split(",")):
        buffer = torch.ones(megabytes * (1 << 20) // 4, dtype=torch.float32)
        print(f"{megabytes:5d} MB fp32 sum {read_gbps(buffer, args.repeats):6.1f} GB/s read")
        del buffer


if __name__ == "__main__":
    main()
