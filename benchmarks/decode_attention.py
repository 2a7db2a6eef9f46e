"""How decode attention scales with mixed context lengths: the torch_native backend's bucketed layout
against padding every request to the longest context, and the native paged decode kernel
(csrc/decode_attention.cpp) built for each ISA this CPU can run, on the same K/V pool.

    .venv/bin/python benchmarks/decode_attention.py [--dtype bfloat16] [--batch 32]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from radixserve.attention.base import AttentionSpec, LayerInputs
from radixserve.attention.torch_native import TorchNativeBackend
from radixserve.forward.batch import build_decode_layout
from radixserve.kernels.cpu_ops import CpuKernels
from radixserve.kernels.native import NativeKernelsUnavailable, executable_isas, load_isa

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M's attention shape


def _time_ms(fn: Callable[[], object], repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def _padded_to_longest(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, lens: torch.Tensor
) -> torch.Tensor:
    """The alternative: every request padded to the batch's longest context, one SDPA call."""
    batch, longest = q.shape[0], int(lens.max())
    valid = torch.arange(longest).unsqueeze(0) < lens.unsqueeze(1)
    slots = torch.where(valid, table[:, :longest], table[:, :1]).reshape(-1)
    shape = (batch, longest, KV_HEADS, HEAD_DIM)
    keys = k_cache.index_select(0, slots).view(shape).transpose(1, 2)
    values = v_cache.index_select(0, slots).view(shape).transpose(1, 2)
    mask = valid.view(batch, 1, 1, longest)
    return F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask, enable_gqa=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    batch = args.batch
    slots = 64 * 1024
    torch.manual_seed(0)
    k_cache = torch.randn(slots, KV_HEADS, HEAD_DIM, dtype=dtype)
    v_cache = torch.randn(slots, KV_HEADS, HEAD_DIM, dtype=dtype)
    q = torch.randn(batch, HEADS, HEAD_DIM, dtype=dtype)
    mixes = {
        "equal 512": [512] * batch,
        "uniform 64..960": [64 + (896 * i) // max(1, batch - 1) for i in range(batch)],
        "one long (1 x 1920, rest 64)": [1920] + [64] * (batch - 1),
    }
    natives = {}
    for isa in ["native", *executable_isas()]:
        try:
            natives[isa] = CpuKernels(load_isa(isa))
        except NativeKernelsUnavailable as error:
            print(f"no {isa} kernels: {error}")
    print(f"decode attention per layer, batch {batch}, {args.dtype}, {HEADS}/{KV_HEADS} heads x {HEAD_DIM}")
    header = f"{'lengths':32s} {'total ctx':>9s} {'bucketed ms':>12s} {'buckets':>8s} {'padded ms':>10s}"
    print(header + "".join(f" {isa + ' ms':>12s}" for isa in natives))
    for name, lengths in mixes.items():
        table = torch.zeros(batch, max(lengths), dtype=torch.int64)
        perm = torch.randperm(slots)
        offset = 0
        for row, n in enumerate(lengths):
            table[row, :n] = perm[offset : offset + n]
            offset += n
        lens = torch.tensor(lengths)
        layout = build_decode_layout(table, torch.arange(batch), lens)
        # No staging: every call gathers from the pool, as a decode step whose batch changed does.
        spec = AttentionSpec(1, HEADS, KV_HEADS, HEAD_DIM, dtype, torch.device("cpu"), None, 0)
        backend = TorchNativeBackend(spec)
        metadata = backend.plan_decode(layout)
        new_kv = k_cache[:batch]  # already "in the pool": only staging would read it
        inputs = LayerInputs(0, q, new_kv, new_kv, k_cache, v_cache, HEAD_DIM**-0.5)
        bucketed = _time_ms(partial(backend.decode, inputs, metadata))
        padded_ms = _time_ms(partial(_padded_to_longest, q, k_cache, v_cache, table, lens))
        rows = torch.arange(batch)
        native = [
            _time_ms(partial(kernels.decode_attention, q, k_cache, v_cache, table, rows, lens, inputs.scale))
            for kernels in natives.values()
        ]
        row = f"{name:32s} {sum(lengths):9d} {bucketed:12.2f} {len(metadata.buckets):8d} {padded_ms:10.2f}"
        print(row + "".join(f" {ms:12.2f}" for ms in native))


if __name__ == "__main__":
    main()
