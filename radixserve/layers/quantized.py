"""GGUF block-quantized weights kept as the file holds them, multiplied by the native kernel
(kernels/csrc/quant_linear.cpp).

A QuantizedTensor is one 2-D weight as rows of ggml blocks. Rows are independent, so a tensor
narrows by rows (a tensor-parallel column shard, the q/k/v of a stacked layer), and by columns only
along whole blocks. A QuantizedWeight is what a linear layer holds instead of a plain or packed
weight: its stacked parts, each in its own format (a Q4_K_M file mixes Q4_K and Q6_K in one q/k/v).
"""

from __future__ import annotations

import ctypes
import mmap
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch

if TYPE_CHECKING:
    from radixserve.kernels.quant_ops import QuantKernels


@dataclass(frozen=True)
class QuantFormat:
    """A ggml block format: its GGUF type id, weights per block and bytes per block."""

    name: str
    type_id: int
    block: int
    block_bytes: int


# The formats with a native kernel: the Q4_K_M / Q5_K_M / Q8_0 files people run, and the legacy ones.
KEPT_FORMATS: dict[str, QuantFormat] = {
    f.name: f
    for f in (
        QuantFormat("Q4_0", 2, 32, 18),
        QuantFormat("Q4_1", 3, 32, 20),
        QuantFormat("Q5_0", 6, 32, 22),
        QuantFormat("Q5_1", 7, 32, 24),
        QuantFormat("Q8_0", 8, 32, 34),
        QuantFormat("Q4_K", 12, 256, 144),
        QuantFormat("Q5_K", 13, 256, 176),
        QuantFormat("Q6_K", 14, 256, 210),
    )
}


class QuantizationError(ValueError):
    """A quantized weight cannot be cut or used as asked (the message says why)."""


@dataclass(frozen=True, eq=False)
class QuantizedTensor:
    """A weight [rows, cols] in ggml blocks: data is uint8 [rows, cols / block * block_bytes].
    `mapped`: data is a view of a read-only file mapping (a GGUF served as it is). `row_order`:
    the weight's row i is data's row row_order[i] (a file storing rows permuted, as llama.cpp's q/k
    are, is read in place rather than copied); None: data's own order. Compared by identity (its
    data is a tensor)."""

    format: QuantFormat
    data: torch.Tensor
    cols: int
    mapped: bool = False
    row_order: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return int(self.data.shape[0] if self.row_order is None else self.row_order.shape[0])

    def blocks(self) -> torch.Tensor:
        """The rows' blocks in the weight's order, [rows, row bytes]: data itself, or gathered."""
        return self.data if self.row_order is None else self.data.index_select(0, self.row_order)

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.cols

    @property
    def nbytes(self) -> int:
        return self.rows * int(self.data.shape[1])

    def narrow_rows(self, start: int, length: int) -> QuantizedTensor:
        if self.row_order is not None:
            return replace(self, row_order=self.row_order.narrow(0, start, length))
        return replace(self, data=self.data.narrow(0, start, length))

    def narrow_cols(self, start: int, length: int) -> QuantizedTensor:
        """Columns [start, start + length), which must fall on block boundaries."""
        block = self.format.block
        if start % block or length % block:
            raise QuantizationError(
                f"a {self.format.name} weight splits only along whole blocks of {block} columns "
                f"(asked for {length} columns from {start})"
            )
        first, count = start // block * self.format.block_bytes, length // block * self.format.block_bytes
        narrowed = self.data.narrow(1, first, count)
        if self.row_order is None and narrowed.is_contiguous():
            # Every column (one rank): still the same view, of the file where it was mapped.
            return replace(self, data=narrowed, cols=length)
        return QuantizedTensor(self.format, self.blocks().narrow(1, first, count).contiguous(), length)

    def dequantize(self) -> torch.Tensor:
        """The weights as fp32 [rows, cols], as gguf (and so transformers) dequantizes them."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        values = dequantize(self.blocks().numpy(), GGMLQuantizationType(self.format.type_id))
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(self.shape))


_MADV_DONTNEED = 4
_LIBC = ctypes.CDLL(None)


def release_mapped_pages(data: torch.Tensor) -> None:
    """Drops the whole pages under `data`, a view of a read-only file mapping, from this process's
    resident memory: the packed copy is what the kernel reads, and the file's page cache keeps the
    bytes for a read back, which maps them again."""
    first = data.data_ptr()
    end = first + (data.shape[0] - 1) * data.stride(0) + data.shape[1] if data.numel() else first
    page = mmap.PAGESIZE
    start, stop = -(-first // page) * page, end // page * page
    if stop > start:
        # Advice only: were it refused, the pages would stay resident, nothing else changes.
        _LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(stop - start), _MADV_DONTNEED)


# What a checkpoint reader yields: a plain tensor, or a GGUF-quantized one.
WeightTensor = torch.Tensor | QuantizedTensor


@dataclass
class QuantizedWeight:
    """A linear weight [N, K] held as quantized parts stacked along N, each packed once for the
    native kernel (QuantKernels.pack); the parts as loaded stay for reading the weight back."""

    parts: list[QuantizedTensor]
    kernels: QuantKernels
    # Counts changes of any quantized weight's layout (packed, refreshed, or turned dense), so that
    # what caches layouts (models/moe_experts.py) knows when to read them again.
    generation: ClassVar[int] = 0

    def __post_init__(self) -> None:
        self.rows = sum(p.rows for p in self.parts)
        self.packed = [self.kernels.pack(p.format.type_id, p.blocks(), p.cols) for p in self.parts]
        for part in self.parts:
            if part.mapped:
                release_mapped_pages(part.data)
        self.refresh()

    def refresh(self) -> None:
        """The kernel's description of the packed parts: their addresses, read again after their
        storage moved (weights released and resumed)."""
        QuantizedWeight.generation += 1
        self.layout = self.kernels.parts_layout(
            [(p.format.type_id, p.rows, packed) for p, packed in zip(self.parts, self.packed, strict=True)]
        )

    def matmul(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x W^T (+ bias) (+ residual, added in fp32 before the output is rounded)."""
        return self.kernels.linear(x, self.layout, self.rows, bias, residual)

    @property
    def row_invariant(self) -> bool:
        """Each output is summed in one order whatever the row count (csrc/quant_linear.cpp)."""
        return True

    def to_dense(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])
