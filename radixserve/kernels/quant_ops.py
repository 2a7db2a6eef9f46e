"""Tensor-level entry points of the quantized-weight kernels (csrc/quant_linear.cpp)."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

# quant_linear_isa()'s values by name (how the kernel multiplies 16-bit integers); 0: the build has no
# such kernel (no AVX2 + FMA + F16C).
QUANT_ISAS = {4: "avx512_vnni", 3: "avx512", 1: "avx2"}


# Parts of one stacked weight the kernel takes (csrc/quant_linear.cpp, kMaxParts).
MAX_PARTS = 3
_DTYPES = (torch.float32, torch.bfloat16)


class QuantKernels:
    """Matmuls on GGUF block-quantized weights, and reading their rows back. A weight comes as raw
    uint8 rows of ggml blocks named by its GGUF type id (layers/quantized.py holds the formats); the
    matmul reads it packed (pack()), and a stacked weight is described to it by parts_layout()."""

    def __init__(self, library: ctypes.CDLL):
        self._isa = int(library.quant_linear_isa())
        self._linear = library.quant_linear_parts
        self._rows = library.quant_dequantize_rows
        self._packed_bytes = library.quant_packed_bytes
        self._pack = library.quant_pack
        self._moe_route = library.moe_route
        self._moe_experts = library.moe_experts
        self._moe_shared_expert = library.moe_shared_expert

    @property
    def available(self) -> bool:
        return self._isa in QUANT_ISAS

    @property
    def isa(self) -> str:
        """How the kernel multiplies in integers: vpdpwssd on AVX-512 ("avx512_vnni"), or vpmaddwd
        on AVX-512 ("avx512") or AVX2 ("avx2")."""
        return QUANT_ISAS.get(self._isa, "none")

    def pack(self, type_id: int, weight: torch.Tensor, cols: int) -> torch.Tensor:
        """A quantized [rows, cols] weight (uint8 [rows, row bytes] as the GGUF file holds it) in the
        matmul's layout (csrc/quant_linear.cpp): 16 rows interleaved per block, as many bytes."""
        rows = int(weight.shape[0])
        size = int(self._packed_bytes(type_id, rows, cols))
        if size == 0:
            raise ValueError(f"no quantized kernel for GGUF type {type_id} in this build")
        packed = torch.empty(size, dtype=torch.uint8)
        self._pack(type_id, weight.data_ptr(), rows, weight.stride(0), cols, packed.data_ptr())
        return packed

    @staticmethod
    def parts_layout(weights: Sequence[tuple[int, int, torch.Tensor]]) -> torch.Tensor:
        """The int64 description of a weight stacked along its rows from `weights` ((type id, rows,
        packed bytes from pack()) each, kept alive by the caller): count, types, rows, addresses."""
        if not 1 <= len(weights) <= MAX_PARTS:
            raise ValueError(f"a quantized weight has 1 to {MAX_PARTS} parts, not {len(weights)}")
        pad = MAX_PARTS - len(weights)
        types = [t for t, _, _ in weights] + [0] * pad
        rows = [r for _, r, _ in weights] + [0] * pad
        addresses = [w.data_ptr() for _, _, w in weights] + [0] * pad
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
            layout.data_ptr(), x.data_ptr(), x.stride(0), int(x.dtype == torch.bfloat16), m, k,
            out.data_ptr(), n, None if bias is None else bias.data_ptr(),
            None if residual is None else residual.data_ptr(), 0 if residual is None else residual.stride(0),
        )  # fmt: skip
        if not done:
            raise ValueError("a part of this quantized weight has no kernel in this build")
        return out

    def moe_route(
        self, logits: torch.Tensor, top_k: int, normalize: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A Mixture-of-Experts router's choice from its fp32 logits [rows, experts]: each row's top_k
        experts (int64, largest probability first) and their softmax probabilities (fp32),
        renormalized to sum to 1 when `normalize` (csrc/moe.cpp)."""
        logits = logits.float().contiguous()
        rows, experts = logits.shape
        chosen = torch.empty((rows, top_k), dtype=torch.int64)
        weights = torch.empty((rows, top_k), dtype=torch.float32)
        self._moe_route(
            logits.data_ptr(), rows, experts, top_k, int(normalize), chosen.data_ptr(), weights.data_ptr()
        )
        return chosen, weights

    def moe(
        self,
        tables: tuple[torch.Tensor, torch.Tensor],
        chosen: torch.Tensor,
        weights: torch.Tensor,
        x: torch.Tensor,
        inter: int,
    ) -> torch.Tensor:
        """A Mixture-of-Experts layer's routed output for x [rows, K]: per row, the sum over its
        experts (chosen, weights: [rows, top_k] from moe_route) of weight x down_e(silu(gate_e x) *
        up_e x), added in fp32 in ascending expert order, in x's dtype. tables: every expert's
        gate_up and down parts_layout() rows ([experts, layout] each), gate_up's parts `inter` gate
        rows then `inter` up rows. Each expert's numbers are those linear() and silu_and_mul give
        its rows alone: the experts a step routes to run in one parallel region per projection."""
        if x.dtype not in _DTYPES or x.dim() != 2 or x.device.type != "cpu":
            raise ValueError(f"expected fp32 or bf16 [rows, k] on the CPU, got {x.dtype} {tuple(x.shape)}")
        if x.stride(1) != 1:
            x = x.contiguous()
        gate_up, down = (t.contiguous() for t in tables)
        chosen, weights = chosen.to(torch.int64).contiguous(), weights.float().contiguous()
        rows, k = x.shape
        out = torch.empty((rows, k), dtype=x.dtype)
        done = self._moe_experts(
            gate_up.data_ptr(), down.data_ptr(), gate_up.shape[0], chosen.data_ptr(), weights.data_ptr(),
            rows, chosen.shape[1], x.data_ptr(), x.stride(0), int(x.dtype == torch.bfloat16), k, inter,
            out.data_ptr(), k,
        )  # fmt: skip
        if not done:
            raise ValueError("a part of these experts has no kernel in this build")
        return out

    def moe_shared_(
        self,
        layouts: tuple[torch.Tensor, torch.Tensor],
        gate: torch.Tensor,
        x: torch.Tensor,
        out: torch.Tensor,
        inter: int,
    ) -> torch.Tensor:
        """out [rows, K] (fp32, contiguous) += sigmoid(gate . x) * down(silu(gate_up x)) per row of x:
        a shared expert (Qwen2-MoE's) whose gate_up (inter gate rows, then inter up rows) and down
        are held in blocks (their parts_layout()s), gate [1, K] fp32 (csrc/moe.cpp). In place."""
        if x.dtype != torch.float32 or out.dtype != torch.float32 or not out.is_contiguous():
            raise ValueError("a shared expert runs natively on fp32 rows into a contiguous fp32 output")
        if x.stride(1) != 1:
            x = x.contiguous()
        gate_up, down = (t.contiguous() for t in layouts)
        gate = gate.float().contiguous()
        rows, k = x.shape
        if not self._moe_shared_expert(
            gate_up.data_ptr(),
            down.data_ptr(),
            gate.data_ptr(),
            x.data_ptr(),
            x.stride(0),
            rows,
            k,
            inter,
            out.data_ptr(),
            k,
        ):
            raise ValueError("a part of this shared expert has no kernel in this build")
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
