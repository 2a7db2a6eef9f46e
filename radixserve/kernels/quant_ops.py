"""Tensor-level entry points of the quantized-weight kernels (csrc/quant_linear.cpp)."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence

import torch

# quant_linear_isa()'s values by name; 0: the build has no such kernel (no AVX2 + FMA + F16C).
QUANT_ISAS = {2: "vnni", 1: "avx2"}
# How the activations meet the weights (csrc/quant_linear.cpp's Mode): "float", the weights
# dequantized in registers against fp32 activations; "int8", the activations rounded to 8-bit
# blocks for integer dot products (docs/architecture.md, "Quantized weights", compares them).
ACTIVATION_MODES = {"int8": 0, "float": 1}
# Forces the mode (for the tests and benchmarks that compare them); unset: DEFAULT_ACTIVATIONS.
ACTIVATIONS_ENV = "RADIXSERVE_QUANT_ACTIVATIONS"
DEFAULT_ACTIVATIONS = "float"


def requested_activations() -> str:
    name = os.environ.get(ACTIVATIONS_ENV, "").strip().lower() or DEFAULT_ACTIVATIONS
    if name not in ACTIVATION_MODES:
        raise ValueError(f"{ACTIVATIONS_ENV}={name!r} is not one of {', '.join(ACTIVATION_MODES)}")
    return name


# Parts of one stacked weight the kernel takes (csrc/quant_linear.cpp, kMaxParts).
MAX_PARTS = 3
_DTYPES = (torch.float32, torch.bfloat16)


class QuantKernels:
    """Matmuls on GGUF block-quantized weights, and reading their rows back. A weight is raw uint8
    rows of ggml blocks named by its GGUF type id (layers/quantized.py holds the formats); a
    stacked weight is described to the kernel by parts_layout()."""

    def __init__(self, library: ctypes.CDLL, activations: str | None = None):
        activations = activations or requested_activations()
        self._isa = int(library.quant_linear_isa())
        self.activations = activations
        self.mode = ACTIVATION_MODES[activations]
        self._linear = library.quant_linear_parts
        self._rows = library.quant_dequantize_rows

    @property
    def available(self) -> bool:
        return self._isa in QUANT_ISAS

    @property
    def isa(self) -> str:
        """How the kernel multiplies in integers: "vnni" (vpdpbusd) or "avx2" (vpmaddubsw)."""
        return QUANT_ISAS.get(self._isa, "none")

    @staticmethod
    def parts_layout(weights: Sequence[tuple[int, torch.Tensor]]) -> torch.Tensor:
        """The int64 description of a weight stacked along its rows from `weights` ((type id,
        uint8 [rows, row bytes]) each, kept alive by the caller): count, types, rows, addresses."""
        if not 1 <= len(weights) <= MAX_PARTS:
            raise ValueError(f"a quantized weight has 1 to {MAX_PARTS} parts, not {len(weights)}")
        pad = MAX_PARTS - len(weights)
        types = [t for t, _ in weights] + [0] * pad
        rows = [int(w.shape[0]) for _, w in weights] + [0] * pad
        addresses = [w.data_ptr() for _, w in weights] + [0] * pad
        return torch.tensor([len(weights), *types, *rows, *addresses], dtype=torch.int64)

    def linear(
        self,
        x: torch.Tensor,
        layout: torch.Tensor,
        n: int,
        bias: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [M, K] W^T (+ bias) (+ residual, added in fp32 before rounding) in x's dtype (fp32 or
        bf16), for W [n, K] as parts_layout() describes it."""
        if x.dtype not in _DTYPES or x.dim() != 2 or x.device.type != "cpu":
            raise ValueError(f"expected fp32 or bf16 [rows, k] on the CPU, got {x.dtype} {tuple(x.shape)}")
        if x.stride(1) != 1:
            x = x.contiguous()
        m, k = x.shape
        out = torch.empty((m, n), dtype=x.dtype)
        if m == 0:
            return out
        if bias is not None:
            bias = bias.to(x.dtype).contiguous()
        if residual is not None:
            residual = residual.to(x.dtype)
            if residual.stride(1) != 1:
                residual = residual.contiguous()
        done = self._linear(
            layout.data_ptr(), self.mode, x.data_ptr(), x.stride(0), int(x.dtype == torch.bfloat16), m, k,
            out.data_ptr(), n, None if bias is None else bias.data_ptr(),
            None if residual is None else residual.data_ptr(), 0 if residual is None else residual.stride(0),
        )  # fmt: skip
        if not done:
            raise ValueError("a part of this quantized weight has no kernel in this build")
        return out

    def rows(self, type_id: int, weight: torch.Tensor, ids: torch.Tensor, cols: int) -> torch.Tensor:
        """Rows `ids` of a quantized [rows, cols] weight, dequantized to fp32 [len(ids), cols]."""
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty((ids.numel(), cols), dtype=torch.float32)
        if ids.numel() and not self._rows(
            type_id, weight.data_ptr(), weight.stride(0), ids.data_ptr(), ids.numel(), cols, out.data_ptr()
        ):
            raise ValueError(f"no quantized kernel for GGUF type {type_id} in this build")
        return out
