"""This machine's peaks for the roofline: the FLOP/s of the matmul the engine's linears run (the
kernel the model runner picks for the same flags, not torch's: torch's bf16 matmul is emulated on a
CPU without AVX-512 BF16) and a large copy's bytes/s."""

from __future__ import annotations

import time
from typing import Any

import torch

from radixserve.config.server_args import ServerArgs
from radixserve.executor.model_runner import pick_dtype
from radixserve.kernels.cpu_ops import select_cpu_kernels
from radixserve.layers.packed_weights import WeightPacking, cpu_packing_supported


def measure_peaks(
    device: torch.device | None = None,
    seconds: float = 1.0,
    dtype: torch.dtype = torch.bfloat16,
    packing: WeightPacking | None = None,
) -> tuple[float, float]:
    """(matmul FLOP/s, copy bytes/s) on `device` (default: this machine's CPU threads). The matmul is
    the one the engine's linears run: with `packing` (a CPU's bf16 weights packed for its kernel:
    engine_linears) that kernel's, else torch's in `dtype`. A GPU gets operands large enough to
    fill it."""
    device = device or torch.device("cpu")
    n, copy_bytes = (8192, 1 << 30) if device.type == "cuda" else (1024, 64 << 20)
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    if packing is not None:
        weight = packing.pack(b)
        flops = _rate(lambda: weight.matmul(a), 2 * n**3, seconds, device)
    else:
        flops = _rate(lambda: torch.mm(a, b), 2 * n**3, seconds, device)
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    bandwidth = _rate(lambda: dst.copy_(src), 2 * src.numel(), seconds, device)  # read + write
    return flops, bandwidth


def engine_linears(args: ServerArgs, device: torch.device) -> tuple[torch.dtype, WeightPacking | None]:
    """The dtype an engine of `args` runs in on `device`, and on a CPU in bf16 how it packs its
    linear weights: the model runner's own choices, made again in this process. The peak must be
    the matmul the engine runs. torch's bf16 matmul on a CPU without AVX-512 BF16 is emulated, a
    hundred times slower than the native kernel the engine runs there (docs/simulator.md)."""
    dtype = pick_dtype(args.dtype, device)
    if device.type != "cpu" or dtype != torch.bfloat16:
        return dtype, None
    kernels = select_cpu_kernels(args.cpu_kernels, device, args.cpu_isa)
    return dtype, WeightPacking(kernels) if cpu_packing_supported(dtype, device, kernels) else None


def _rate(work: Any, units: float, seconds: float, device: torch.device) -> float:
    # A GPU runs work asynchronously: time whole batches of it, each ended by a synchronize.
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    batch = 10 if device.type == "cuda" else 1
    work()
    sync()
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(batch):
            work()
        sync()
        done += batch
    return units * done / (time.perf_counter() - start)
