"""bf16 linear weights on a CPU, held only in a matmul kernel's own layout.

The kernel is chosen once per process (CpuKernels.linear_kernel) and each weight packed for it
when the model is loaded (WeightPacking):
- the native AMX matmul (kernels/csrc/amx_linear.cpp) where the CPU has AMX and the shape suits it
  (both sizes multiples of 32): faster than oneDNN at every row count measured;
- else the native AVX-512 BF16 / AVX-512F / AVX2 matmul (kernels/csrc/bf16_linear.cpp) where the
  build has AVX2 + FMA or more and the shape suits it (N a multiple of 16, K of 2);
- else oneDNN's packed layout, faster than F.linear on a plain weight, where oneDNN packs bf16
  (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT: an AVX2-only CPU has neither);
- else the plain weight and F.linear.
A weight the native kernel declines is counted (kernel_fallbacks) and takes the next of these.
Figures: docs/architecture.md ("CPU specifics").
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from radixserve.kernels.cpu_ops import CpuKernels


@functools.cache
def onednn_packs_bf16() -> bool:
    """Whether oneDNN packs bf16 weights on this CPU: its reorder raises where the CPU lacks the
    instructions its bf16 path needs (AVX-512 BW/VL/DQ or AVX-NE-CONVERT)."""
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), None)
    except RuntimeError:
        return False
    return True


def cpu_packing_supported(
    dtype: torch.dtype, device: torch.device, kernels: CpuKernels | None = None
) -> bool:
    """Whether bf16 linear weights are packed here: a native linear kernel or oneDNN can take them."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return False
    return (kernels is not None and kernels.linear_kernel is not None) or onednn_packs_bf16()


@dataclass
class PackedWeight:
    """A linear weight [N, K] in a kernel's layout: the native kernel's of `kernels`; oneDNN's when
    kernels is None and onednn; the plain weight (F.linear) when neither."""

    data: torch.Tensor
    kernels: CpuKernels | None
    onednn: bool = True

    def matmul(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x W^T (+ bias) (+ residual, added to the fp32 sum before rounding: one pass less, and
        closer to the fp32 result; F.linear adds it after rounding)."""
        if self.kernels is not None:
            return self.kernels.linear(x, self.data, bias, residual)
        if self.onednn:
            return onednn_linear(x, self.data, bias, residual)
        out = F.linear(x, self.data, bias)
        return out if residual is None else out + residual

    @property
    def row_invariant(self) -> bool:
        """Whether each output row is summed in an order independent of how many rows the call
        has (batch-invariant inference needs it): the native kernels' fixed blocking does; oneDNN
        picks its kernel and blocking from the row count."""
        return self.kernels is not None

    def to_dense(self) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.unpack_linear(self.data)
        return self.data.to_dense() if self.onednn else self.data


@dataclass(frozen=True)
class WeightPacking:
    """How this process packs bf16 linear weights: for the native matmul of `kernels` where it
    takes them, else for oneDNN where it packs bf16, else not at all."""

    kernels: CpuKernels | None = None

    def pack(self, weight: torch.Tensor) -> PackedWeight:
        if self.kernels is not None:
            tiles = self.kernels.pack_linear(weight)
            if tiles is not None:
                return PackedWeight(tiles, self.kernels)
        if onednn_packs_bf16():
            return PackedWeight(torch.ops.mkldnn._reorder_linear_weight(weight, None), None)
        return PackedWeight(weight, None, onednn=False)

    @property
    def kernel(self) -> str:
        """The linear kernel of this process, as /get_server_info reports it."""
        if self.kernels is not None and self.kernels.linear_kernel is not None:
            return self.kernels.linear_kernel
        return "onednn" if onednn_packs_bf16() else "F.linear"


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
