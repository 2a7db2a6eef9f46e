"""Gated activations, SiLU(gate) * up and GELU-tanh(gate) * up, on the native kernel where one runs."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from radixserve.kernels.cpu_ops import CpuKernels


def silu_and_mul(gate_up: torch.Tensor, kernels: CpuKernels | None = None) -> torch.Tensor:
    return _gated(gate_up, None if kernels is None else kernels.silu_and_mul, F.silu)


def gelu_tanh_and_mul(gate_up: torch.Tensor, kernels: CpuKernels | None = None) -> torch.Tensor:
    gelu_tanh = functools.partial(F.gelu, approximate="tanh")
    return _gated(gate_up, None if kernels is None else kernels.gelu_tanh_and_mul, gelu_tanh)


def _gated(
    gate_up: torch.Tensor,
    native: Callable[[torch.Tensor], torch.Tensor | None] | None,
    activation: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """activation(gate) * up for gate_up = [gate | up], on the native kernel if it takes it."""
    if native is not None:
        fused = native(gate_up)
        if fused is not None:
            return fused
    gate, up = gate_up.chunk(2, dim=-1)
    return activation(gate) * up
