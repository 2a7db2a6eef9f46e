"""Rotary position embedding (half-split "neox" layout) and its per-batch lookup."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from radixserve.kernels.cpu_ops import CpuKernels


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (half-split "neox" layout, as in HF Llama/Qwen checkpoints)."""

    def __init__(self, head_dim: int, max_positions: int, base: float, scaling: dict[str, Any] | None):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        inv_freq = _apply_rope_scaling(inv_freq, scaling)
        # The tables stay fp32 whatever the model dtype: far positions need the precision.
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)
        self.cos: torch.Tensor
        self.sin: torch.Tensor

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype, kernels: CpuKernels | None = None) -> Rope:
        """The rotation for one forward's positions."""
        return Rope(positions, self.cos, self.sin, dtype, kernels)


@dataclass
class Rope:
    """Rotary embedding of one batch's positions; the rotation runs in the model's dtype, as in the
    reference implementation."""

    positions: torch.Tensor
    cos_table: torch.Tensor  # [max_positions, head_dim / 2], fp32
    sin_table: torch.Tensor
    dtype: torch.dtype
    kernels: CpuKernels | None = None

    @functools.cached_property
    def _rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[cos, cos] and [-sin, sin] rows for the positions, shaped to broadcast over heads; built
        once per forward, and only by the torch path."""
        cos = self.cos_table[self.positions].unsqueeze(1)
        sin = self.sin_table[self.positions].unsqueeze(1)
        return torch.cat((cos, cos), dim=-1).to(self.dtype), torch.cat((-sin, sin), dim=-1).to(self.dtype)

    def rotate_(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim] (query heads, key heads, or both stacked), rotated. The native
        kernel rotates x in place; the torch path returns a new tensor.

        (x1, x2) → (x1·cos − x2·sin, x2·cos + x1·sin) in four passes over x instead of seven, and
        bit for bit the same: the sign sits in the table, and a + (−b) rounds as a − b."""
        if self.kernels is not None and self.kernels.rotary_(
            x, self.cos_table, self.sin_table, self.positions
        ):
            return x
        cos, signed_sin = self._rows
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((x2, x1), dim=-1) * signed_sin


def _apply_rope_scaling(inv_freq: torch.Tensor, scaling: dict[str, Any] | None) -> torch.Tensor:
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        original = float(scaling["original_max_position_embeddings"])
        low_wavelen = original / low
        high_wavelen = original / high
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, and the band between interpolated.
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        in_band = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(in_band, blended, scaled)
    raise ValueError(f"rope scaling type {kind!r} is not supported (supported: default, linear, llama3)")
