"""RMSNorm, on the native kernel where one runs (normalized in fp32, scaled in the model dtype)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.layers.linear import copy_checked

if TYPE_CHECKING:
    from radixserve.kernels.cpu_ops import CpuKernels


class RMSNorm(nn.Module):
    # Whether the native kernel scales by 1 + weight (Gemma's norm, whose reference() says so too).
    unit_offset = False

    def __init__(self, size: int, eps: float, kernels: CpuKernels | None = None):
        super().__init__()
        self.eps = eps
        self.kernels = kernels
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    def load(self, name: str, tensor: torch.Tensor, shard: int = 0) -> None:
        copy_checked(self.weight.data, tensor, "norm weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            fused = self.kernels.rms_norm(x, self.weight, self.eps, self.unit_offset)
            if fused is not None:
                return fused
        return self.reference(x)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The norm on torch ops."""
        # Normalize in fp32, round, then scale in the model dtype, as the reference implementation
        # does, so that bf16 outputs track transformers'. (F.rms_norm straight on bf16 is about as
        # accurate against fp32, but breaks knife-edge ties differently.)
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return self.weight * normed.to(x.dtype)
