"""Gemma 3's text decoder (Gemma3ForCausalLM): the Llama family's attention and linears, arranged
as Gemma arranges them.

What differs from models/llama.py: a norm before and after both the attention and the MLP of every
layer (the residual added after the second), Gemma's RMSNorm (normalized and scaled by 1 + weight in
fp32, rounded once), per-head q/k norms, GELU (tanh approximation) gating the MLP, token
embeddings scaled by sqrt(hidden_size) in the model's dtype, queries scaled by
query_pre_attn_scalar ** -0.5, and two kinds of layers: sliding ones, which see their last
`sliding_window` positions and turn on a rotary base of their own (rope_local_base_freq), and
global ones, which see the whole context on rope_theta (and its scaling).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from radixserve.attention.base import AttentionCall
from radixserve.distributed.parallel import SINGLE, ParallelContext
from radixserve.kernels.cpu_ops import FusedFlavor
from radixserve.layers.activation import gelu_tanh_and_mul
from radixserve.layers.linear import ColumnParallelLinear, RowParallelLinear
from radixserve.layers.norm import RMSNorm
from radixserve.layers.rotary import Rope, RotaryEmbedding
from radixserve.models.config import ModelConfig
from radixserve.models.fused_decode import FusedLayer
from radixserve.models.llama import Attention, CausalLM

if TYPE_CHECKING:
    from radixserve.kernels.cpu_ops import CpuKernels


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + weight), computed in fp32 and rounded to x's dtype once at the end (the
    checkpoint's weight is the offset from 1): the native norm kernel's unit_offset mode, else torch
    ops."""

    unit_offset = True

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.float()
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class GemmaMLP(nn.Module):
    def __init__(self, config: ModelConfig, ctx: ParallelContext, kernels: CpuKernels | None):
        super().__init__()
        self.kernels = kernels
        size = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [size, size], bias=False, ctx=ctx)
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=False, ctx=ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x), self.kernels))
        return out


@dataclass(frozen=True)
class GemmaRopes:
    """One forward's rotations: the global layers' and the sliding layers'."""

    full: Rope
    sliding: Rope


class Gemma3DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        ctx: ParallelContext,
        kernels: CpuKernels | None,
        window: int | None,
    ):
        super().__init__()
        self.sliding = window is not None
        self.self_attn = Attention(config, layer_id, ctx, kernels, window, norm=GemmaRMSNorm)
        self.mlp = GemmaMLP(config, ctx, kernels)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps, kernels)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps, kernels)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps, kernels)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps, kernels)

    def forward(self, hidden: torch.Tensor, attention: AttentionCall, ropes: GemmaRopes) -> torch.Tensor:
        rope = ropes.sliding if self.sliding else ropes.full
        attended = self.self_attn(self.input_layernorm(hidden), attention, rope, residual=None)
        hidden = hidden + self.post_attention_layernorm(attended)
        fed = self.mlp(self.pre_feedforward_layernorm(hidden))
        out: torch.Tensor = hidden + self.post_feedforward_layernorm(fed)
        return out

    def fused_layer(self) -> FusedLayer:
        """This layer's parts as the fused decode loop reads them (the norm before the MLP in
        post_norm's place, the two output norms, the window and the local rotary tables)."""
        attn = self.self_attn
        assert attn.q_norm is not None and attn.k_norm is not None
        return FusedLayer(
            input_norm=self.input_layernorm.weight,
            qkv_bias=attn.qkv_proj.bias,
            post_norm=self.pre_feedforward_layernorm.weight,
            linears=(attn.qkv_proj, attn.o_proj, self.mlp.gate_up_proj, self.mlp.down_proj),
            q_norm=attn.q_norm.weight,
            k_norm=attn.k_norm.weight,
            attn_out_norm=self.post_attention_layernorm.weight,
            mlp_out_norm=self.post_feedforward_layernorm.weight,
            window=attn.window,
            local_rope=self.sliding,
        )


class Gemma3CausalLM(CausalLM):
    """The model's loading, pipeline stages and logits are CausalLM's; its layers, norms, embedding
    scale and rotations are Gemma's."""

    norm_class = GemmaRMSNorm
    fused_flavor = FusedFlavor.UNIT_OFFSET_NORMS | FusedFlavor.GELU_TANH

    def __init__(
        self,
        config: ModelConfig,
        max_positions: int,
        ctx: ParallelContext = SINGLE,
        kernels: CpuKernels | None = None,
    ):
        super().__init__(config, max_positions, ctx, kernels)
        theta = config.rope_theta if config.sliding_rope_theta is None else config.sliding_rope_theta
        self.sliding_rotary = RotaryEmbedding(
            config.head_dim, max_positions, theta, config.sliding_rope_scaling
        )
        # sqrt(hidden_size) as an fp32 number, then in the model's dtype (bf16 rounds it), as the
        # reference multiplies the embeddings by it.
        self.embed_scale = float(torch.tensor(math.sqrt(config.hidden_size)).to(self.activation_dtype))

    def make_layer(
        self, config: ModelConfig, local: int, index: int, ctx: ParallelContext, kernels: CpuKernels | None
    ) -> nn.Module:
        return Gemma3DecoderLayer(config, local, ctx, kernels, config.layer_window(index))

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> GemmaRopes:
        return GemmaRopes(
            full=self.rotary.lookup(positions, dtype, self.kernels),
            sliding=self.sliding_rotary.lookup(positions, dtype, self.kernels),
        )

    def fused_ropes(self, rope: GemmaRopes) -> tuple[Rope, Rope | None]:
        return rope.full, rope.sliding

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return super().embed(ids) * self.embed_scale
