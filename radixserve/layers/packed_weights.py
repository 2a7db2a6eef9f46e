"""bf16 linear weights on a CPU, held only in a matmul kernel's own layout.

Two kernels, chosen per weight when the model is loaded (WeightPacking):
- the native AMX matmul (radixserve/kernels/csrc/amx_linear.cpp) where the CPU has AMX and the
  shape suits it (both sizes multiples of 32): faster than oneDNN at every row count measured;
- oneDNN's packed layout otherwise, faster than F.linear on a plain weight.
Figures: docs/architecture.md ("CPU specifics").
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from radixserve.kernels.cpu_ops import CpuKernels


def cpu_packing_supported(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype == torch.bfloat16 and onednn_bf16_available()


@functools.cache
def onednn_bf16_available() -> bool:
    """Whether oneDNN packs bf16 weights on this CPU: it needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT,
    and refuses with an error elsewhere (an AVX2-only CPU such as a Zen 3), where bf16 linears
    then run on F.linear."""
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), None)
    except RuntimeError:
        return False
    return True


@dataclass
class PackedWeight:
    """A linear weight [N, K] in a kernel's layout: the AMX tiles of `kernels`, or oneDNN's layout
    when kernels is None."""

    data: torch.Tensor
    kernels: CpuKernels | None

    def matmul(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x W^T (+ bias) (+ residual, added to the fp32 sum before rounding: one pass less, and
        closer to the fp32 result)."""
        if self.kernels is not None:
            return self.kernels.linear(x, self.data, bias, residual)
        return onednn_linear(x, self.data, bias, residual)

    @property
    def row_invariant(self) -> bool:
        """Whether each output row is summed in an order independent of how many rows the call
        has (batch-invariant inference needs it): the native kernels' fixed blocking does; oneDNN
        picks its kernel and blocking from the row count."""
        return self.kernels is not None

    def to_dense(self) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.unpack_linear(self.data)
        return self.data.to_dense()


@dataclass(frozen=True)
class WeightPacking:
    """How this process packs bf16 linear weights: for the AMX matmul of `kernels` where it runs
    them, else for oneDNN."""

    kernels: CpuKernels | None = None

    def pack(self, weight: torch.Tensor) -> PackedWeight:
        if self.kernels is not None:
            tiles = self.kernels.pack_linear(weight)
            if tiles is not None:
                return PackedWeight(tiles, self.kernels)
        return PackedWeight(torch.ops.mkldnn._reorder_linear_weight(weight, None), None)


def onednn_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x W^T (+ bias) (+ residual) with a oneDNN-packed weight.

    oneDNN builds (JIT-compiles) a kernel for every new row count, which can cost more than the
    matmul itself, and its cache keeps a bounded number of shapes. Prefill row counts are nearly
    always new, so the rows are padded to one of eight sizes per power of two (at most an eighth
    more rows) and each size is compiled once. Rows do not mix in a matmul: results are unchanged."""
    rows = x.shape[0]
    padded = round_up_to_eighth(rows)
    if padded != rows:
        x = _pad_rows(x, padded)
        residual = None if residual is None else _pad_rows(residual, padded)
    if residual is None:
        out = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    else:
        out = torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, bias, "add")
    result: torch.Tensor = out if padded == rows else out[:rows]
    return result


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x with zero rows appended up to `rows`; one pass over x (F.pad zero-fills everything first)."""
    padded = x.new_empty((rows, x.shape[1]))
    padded[: x.shape[0]] = x
    padded[x.shape[0] :].zero_()
    return padded


def round_up_to_eighth(n: int) -> int:
    """n rounded up to a multiple of 1/8 of its power of two (exact up to 16): eight sizes per
    octave, at most 12.5% more than n."""
    if n <= 16:
        return n
    step = 1 << (n.bit_length() - 4)
    return -(-n // step) * step
