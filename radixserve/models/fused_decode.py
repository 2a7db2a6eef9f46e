"""Decode steps with every decoder layer in one native call (kernels/csrc/fused_decode.cpp).

Taken when everything a layer runs has a native kernel: bf16 on a CPU with AMX (every linear packed
for the AMX matmul), one tensor-parallel rank, no q/k norms, and a head shape the decode and prefix
attention kernels are compiled for. The native loop runs the same kernels in the same order as the
per-layer path, so the result is bit for bit the same (tested); what goes is the Python and
dispatch cost of ~15 calls per layer, a third of a SmolLM2-135M decode step at batch 32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from radixserve.forward.batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from radixserve.cache.pools import KVCachePool
    from radixserve.kernels.cpu_ops import CpuKernels
    from radixserve.layers.basic import Rope, _Linear
    from radixserve.models.llama import CausalLM, DecoderLayer


@dataclass
class FusedLayer:
    """One layer's parts the native loop reads, in its order (linears: qkv, o, gate/up, down)."""

    input_norm: torch.Tensor
    qkv_bias: torch.Tensor | None
    post_norm: torch.Tensor
    linears: tuple[_Linear, _Linear, _Linear, _Linear]


@dataclass
class FusedDecodePlan:
    """A model's layers as the native loop takes them, looked up once per model: nn.Module
    attribute lookups cost more than reading the addresses each step."""

    kernels: CpuKernels
    layers: list[FusedLayer]
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    scale: float

    def ready(self) -> bool:
        """Every linear is (still) packed for the AMX matmul."""
        return all(
            linear.packed is not None and linear.packed.kernels is not None
            for layer in self.layers
            for linear in layer.linears
        )

    def pointers(self, kv_pool: KVCachePool) -> torch.Tensor:
        """[layers, 9] int64 addresses: input norm, qkv, qkv bias (0: none), o, post-attention
        norm, gate/up, down, K pool, V pool. Read every step: weights are repacked on updates and
        the pool is reallocated after a release."""
        rows = []
        for index, layer in enumerate(self.layers):
            qkv, o, gate_up, down = (linear.packed.data.data_ptr() for linear in layer.linears)  # type: ignore[union-attr]
            bias = 0 if layer.qkv_bias is None else layer.qkv_bias.data_ptr()
            k_pool, v_pool = kv_pool.k_buffers[index].data_ptr(), kv_pool.v_buffers[index].data_ptr()
            norms = layer.input_norm.data_ptr(), layer.post_norm.data_ptr()
            rows.append([norms[0], qkv, bias, o, norms[1], gate_up, down, k_pool, v_pool])
        return torch.tensor(rows, dtype=torch.int64)


def fused_decode_plan(model: CausalLM) -> FusedDecodePlan | None:
    """The model's plan, or None when its decode steps cannot run fused (the module's docstring)."""
    if model.fused_plan_checked:
        return model.fused_plan
    model.fused_plan_checked = True
    kernels, config = model.kernels, model.config
    if kernels is None or not kernels.has_amx_linear or config.qk_norm or config.head_dim % 32:
        return None
    layers = cast("list[DecoderLayer]", list(model.layers))
    first = layers[0]
    attention = first.self_attn
    if attention.o_proj.ctx.tp_size != 1 or not kernels.handles_decode_attention(
        attention.num_heads, attention.num_kv_heads, config.head_dim, torch.bfloat16
    ):
        return None
    if any(
        layer.self_attn.o_proj.bias is not None or layer.mlp.down_proj.bias is not None for layer in layers
    ):
        return None
    model.fused_plan = FusedDecodePlan(
        kernels=kernels,
        layers=[
            FusedLayer(
                input_norm=layer.input_layernorm.weight,
                qkv_bias=layer.self_attn.qkv_proj.bias,
                post_norm=layer.post_attention_layernorm.weight,
                linears=(
                    layer.self_attn.qkv_proj,
                    layer.self_attn.o_proj,
                    layer.mlp.gate_up_proj,
                    layer.mlp.down_proj,
                ),
            )
            for layer in layers
        ],
        heads=attention.num_heads,
        kv_heads=attention.num_kv_heads,
        head_dim=config.head_dim,
        intermediate=first.mlp.down_proj.local_input,
        eps=first.input_layernorm.eps,
        scale=attention.scale,
    )
    return model.fused_plan


def fused_decode(
    model: CausalLM, hidden: torch.Tensor, batch: ForwardBatch, kv_pool: KVCachePool, rope: Rope
) -> torch.Tensor | None:
    """hidden after every decoder layer, or None when this step cannot run fused (the caller then
    runs the layers one by one)."""
    layout = batch.decode
    if batch.mode is not ForwardMode.DECODE or layout is None or hidden.dtype != torch.bfloat16:
        return None
    plan = fused_decode_plan(model)
    if plan is None or not plan.ready():
        return None
    hidden = hidden.contiguous()
    plan.kernels.fused_decode(
        plan.pointers(kv_pool),
        hidden,
        heads=plan.heads,
        kv_heads=plan.kv_heads,
        head_dim=plan.head_dim,
        intermediate=plan.intermediate,
        eps=plan.eps,
        scale=plan.scale,
        rope=rope,
        out_slots=batch.out_cache_loc,
        layout=layout,
    )
    return hidden
