"""Decode steps with every decoder layer in one native call (kernels/csrc/fused_decode.cpp).

Taken when everything a layer runs has a native kernel: bf16 on a CPU with AMX (every linear packed
for the AMX matmul), one tensor-parallel rank, no q/k norms, and a head shape the decode and prefix
attention kernels are compiled for. The native loop runs the same kernels in the same order as the
per-layer path, so the result is bit for bit the same (tested); what goes is the Python and
dispatch cost of ~15 calls per layer, a third of a SmolLM2-135M decode step at batch 32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

from radixserve.model.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from radixserve.cache.pools import KVCachePool
    from radixserve.model.layers import Rope, _Linear
    from radixserve.model.llama import CausalLM, DecoderLayer


def fused_decode_applies(model: CausalLM) -> bool:
    """Whether this model's decode steps run fused (see the module's docstring)."""
    kernels, config = model.kernels, model.config
    if kernels is None or not kernels.has_amx_linear or config.qk_norm or config.head_dim % 32:
        return False
    layers = _decoder_layers(model)
    attention = layers[0].self_attn
    if attention.o_proj.ctx.tp_size != 1 or not kernels.handles_decode_attention(
        attention.num_heads, attention.num_kv_heads, config.head_dim, torch.bfloat16
    ):
        return False
    for layer in layers:
        if any(linear.packed is None or linear.packed.kernels is None for linear in _linears(layer)):
            return False
        if layer.self_attn.o_proj.bias is not None or layer.mlp.down_proj.bias is not None:
            return False
    return True


def fused_decode(
    model: CausalLM, hidden: torch.Tensor, batch: ForwardBatch, kv_pool: KVCachePool, rope: Rope
) -> torch.Tensor | None:
    """hidden after every decoder layer, or None when this step cannot run fused (the caller then
    runs the layers one by one)."""
    layout = batch.decode
    if batch.mode is not ForwardMode.DECODE or layout is None or hidden.dtype != torch.bfloat16:
        return None
    if not fused_decode_applies(model):
        return None
    kernels = model.kernels
    assert kernels is not None
    first = _decoder_layers(model)[0]
    hidden = hidden.contiguous()
    kernels.fused_decode(
        _layer_pointers(model, kv_pool),
        hidden,
        heads=first.self_attn.num_heads,
        kv_heads=first.self_attn.num_kv_heads,
        head_dim=model.config.head_dim,
        intermediate=first.mlp.down_proj.local_input,
        eps=first.input_layernorm.eps,
        scale=first.self_attn.scale,
        rope=rope,
        out_slots=batch.out_cache_loc,
        layout=layout,
    )
    return hidden


def _decoder_layers(model: CausalLM) -> list[DecoderLayer]:
    return cast("list[DecoderLayer]", list(model.layers))


def _linears(layer: DecoderLayer) -> tuple[_Linear, _Linear, _Linear, _Linear]:
    """qkv, o, gate/up, down: the native loop's order."""
    attention, mlp = layer.self_attn, layer.mlp
    return attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj


def _layer_pointers(model: CausalLM, kv_pool: KVCachePool) -> torch.Tensor:
    """[layers, 9] int64 addresses of each layer's weights and K/V pool, in the native loop's order:
    input norm, qkv, qkv bias (0: none), o, post-attention norm, gate/up, down, K pool, V pool."""
    rows = []
    for index, layer in enumerate(_decoder_layers(model)):
        qkv, o, gate_up, down = (linear.packed.data.data_ptr() for linear in _linears(layer))  # type: ignore[union-attr]
        bias = layer.self_attn.qkv_proj.bias
        rows.append(
            [
                layer.input_layernorm.weight.data_ptr(),
                qkv,
                0 if bias is None else bias.data_ptr(),
                o,
                layer.post_attention_layernorm.weight.data_ptr(),
                gate_up,
                down,
                kv_pool.k_buffers[index].data_ptr(),
                kv_pool.v_buffers[index].data_ptr(),
            ]
        )
    return torch.tensor(rows, dtype=torch.int64)
