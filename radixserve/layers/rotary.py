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
    """Rotary position embedding (half-split "neox" layout, as in HF Llama/Qwen checkpoints).
    head_dim: the dimensions it turns (the leading ones of each head; a partial rotary factor
    leaves the rest unrotated)."""

    def __init__(self, head_dim: int, max_positions: int, base: float, scaling: dict[str, Any] | None):
        super().__init__()
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq = 1.0 / (base**exponents)
        # The tables stay fp32 whatever the model dtype: far positions need the precision.
        positions = torch.arange(max_positions, dtype=torch.float32)
        kind = "default" if not scaling else scaling.get("rope_type", scaling.get("type", "default"))
        attention_factor = 1.0
        if kind == "longrope":
            freqs, attention_factor = _longrope_freqs(positions, base**exponents, scaling or {})
        elif kind == "dynamic":
            freqs = _dynamic_ntk_freqs(positions, exponents, base, head_dim, scaling or {})
        else:
            if kind == "yarn":
                inv_freq, attention_factor = _yarn(inv_freq, base**exponents, head_dim, base, scaling or {})
            else:
                inv_freq = _apply_rope_scaling(inv_freq, scaling)
            freqs = torch.outer(positions, inv_freq)
        # YaRN and LongRoPE scale the rotation's magnitude too (a temperature on the attention).
        self.register_buffer("cos", freqs.cos() * attention_factor, persistent=False)
        self.register_buffer("sin", freqs.sin() * attention_factor, persistent=False)
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
        kernel rotates x in place; the torch path returns a new tensor. Where the tables cover
        fewer dimensions than a head (a partial rotary factor), only the leading ones turn.

        (x1, x2) → (x1·cos − x2·sin, x2·cos + x1·sin) in four passes over x instead of seven, and
        bit for bit the same: the sign sits in the table, and a + (−b) rounds as a − b."""
        if self.kernels is not None and self.kernels.rotary_(
            x, self.cos_table, self.sin_table, self.positions
        ):
            return x
        rotary = 2 * self.cos_table.shape[1]
        if rotary < x.shape[-1]:
            turned = self._turn(x[..., :rotary])
            return torch.cat((turned, x[..., rotary:]), dim=-1)
        return self._turn(x)

    def _turn(self, x: torch.Tensor) -> torch.Tensor:
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
    raise ValueError(
        f"rope scaling type {kind!r} is not supported "
        "(supported: default, linear, llama3, yarn, longrope, dynamic)"
    )


def _yarn(
    inv_freq: torch.Tensor, wavelength_base: torch.Tensor, head_dim: int, base: float, scaling: dict[str, Any]
) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023): dimensions that turn fewer than beta_slow times over the original
    context are interpolated (their frequency divided by `factor`), those that turn more than
    beta_fast times are kept, and a linear ramp blends the ones between; the rotation's magnitude
    is scaled by 0.1 ln(factor) + 1 (or the ratio of two such terms, DeepSeek's mscale pair)."""
    original = float(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor")
    factor = float(factor) if factor is not None else float(scaling["max_position_embeddings"]) / original
    fast, slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def dimension_turning(turns: float) -> float:
        """The (fractional) rotary dimension whose frequency turns `turns` times over the context."""
        return head_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension_turning(fast), dimension_turning(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp
    interpolated = 1.0 / (factor * wavelength_base)
    blended = interpolated * (1 - kept) + inv_freq * kept

    def magnitude(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all:
            attention = magnitude(factor, float(mscale)) / magnitude(factor, float(mscale_all))
        else:
            attention = magnitude(factor)
    return blended, float(attention)


def _longrope_freqs(
    positions: torch.Tensor, wavelength_base: torch.Tensor, scaling: dict[str, Any]
) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3): per-dimension factors stretch each frequency, the short factors within
    the original context and the long ones past it, and the magnitude grows by
    sqrt(1 + ln(factor) / ln(original context)). The choice is per position: a cached key keeps
    the rotation it was stored with. transformers instead rotates a whole sequence by the long
    factors once it grows past the original context, which a KV cache cannot follow: the two agree
    on every sequence within it."""
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor")
    factor = float(factor) if factor is not None else float(scaling["max_position_embeddings"]) / original
    short = 1.0 / (torch.tensor(scaling["short_factor"], dtype=torch.float32) * wavelength_base)
    long = 1.0 / (torch.tensor(scaling["long_factor"], dtype=torch.float32) * wavelength_base)
    freqs = torch.cat([torch.outer(positions[:original], short), torch.outer(positions[original:], long)])
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return freqs, float(attention)


def _dynamic_ntk_freqs(
    positions: torch.Tensor, exponents: torch.Tensor, base: float, head_dim: int, scaling: dict[str, Any]
) -> torch.Tensor:
    """Dynamic NTK scaling: within the original context the plain rotation; past it, position p
    turns on the base NTK-scaled for a sequence of p + 1 tokens,
    base * (factor * (p + 1) / original - (factor - 1)) ** (dim / (dim - 2)). That is what
    transformers gives a token it computes alone at that position (a decode step, the cached keys
    keeping their own rotations); its prefill of a prompt longer than the original context turns
    the whole prompt on that prompt's length's base, which a KV cache shared across lengths cannot
    follow. The two agree on every sequence within the original context, and on tokens generated
    one by one past it."""
    original = int(scaling["original_max_position_embeddings"])
    factor = float(scaling["factor"])
    within = torch.outer(positions[:original], 1.0 / (base**exponents))
    beyond = positions[original:]
    bases = base * ((factor * (beyond + 1) / original) - (factor - 1)) ** (head_dim / (head_dim - 2))
    return torch.cat([within, beyond[:, None] * (1.0 / (bases[:, None] ** exponents))])
