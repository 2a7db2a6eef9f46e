"""SiLU(gate) * up, on the native kernel where one runs."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from radixserve.kernels.cpu_ops import CpuKernels


def silu_and_mul(gate_up: torch.Tensor, kernels: CpuKernels | None = None) -> torch.Tensor:
    if kernels is not None:
        fused = kernels.silu_and_mul(gate_up)
        if fused is not None:
            return fused
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
