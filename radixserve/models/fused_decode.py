"""Decode steps with every decoder layer in one native call (kernels/csrc/fused_decode.cpp).

A model class that can run this way declares it (`fused_decode_plan()` on the Llama family); the
model runner asks once at startup and takes it when everything a layer runs has a native kernel:
bf16 on a CPU with a native linear kernel (every linear packed for the AMX matmul, or for
csrc/bf16_linear.cpp on AVX2 / AVX-512 CPUs without AMX), or GGUF-quantized weights in bf16 or fp32
(over a KV pool in that dtype, or in bf16 under fp32), one tensor-parallel rank, q/k norms per head,
over each projection's width with OLMoE's clip_qkv (fp32), or none, a head shape the decode
attention kernel is compiled for, and the cpu_native attention backend. Mixture-of-Experts layers
run in it with fp32 activations and every expert held in blocks, a shared one too (Qwen3-MoE,
Mixtral, OLMoE, Qwen2-MoE): the router, the routing, the experts and the shared expert on the same
native calls as the per-layer path (models/moe.py); a step runs per layer while an expert is dense
or while the routed experts are being counted (/start_expert_distribution_record). Sliding-window
layers run in it with their windows, and Gemma 3's layers with their own norms, GELU-tanh MLP and
second rotary base. The native loop runs the same kernels in the same order as the per-layer path,
so the result is bit for bit the same (tests/models/test_fused_decode.py); what goes is the Python
and dispatch cost of ~15 calls per layer (figures: docs/architecture.md). A step whose requests
share a prefix runs here too where a native prefix attention kernel exists for the head shape (AMX
tiles, else vector FMAs: csrc/prefix_attention.cpp); else it runs per layer, its shared part on
torch's flash attention, which no native kernel reproduces bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.attention.base import AttentionCall
from radixserve.attention.cpu_native import CpuDecodeMetadata
from radixserve.kernels.cpu_ops import CpuKernels, ExpertShape, FusedFlavor, WindowSlots
from radixserve.layers.linear import ParallelLinear
from radixserve.layers.packed_weights import PackedWeight
from radixserve.layers.quantized import QuantizedWeight
from radixserve.layers.rotary import Rope
from radixserve.models.moe import SparseMoE


@dataclass
class FusedLayer:
    """One layer's parts the native loop reads, in its order (linears: qkv, o, then a dense MLP's
    gate/up and down; a Mixture-of-Experts layer has `experts` in their place). post_norm is the
    norm before the MLP; attn_out_norm and mlp_out_norm (Gemma's) norm the attention's and the
    MLP's outputs before they join the residual stream. window: a sliding layer's; local_rope:
    whether the layer turns on the model's second rotary tables (Gemma's sliding layers)."""

    input_norm: torch.Tensor
    qkv_bias: torch.Tensor | None
    post_norm: torch.Tensor
    linears: tuple[ParallelLinear, ...]
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    experts: SparseMoE | None = None
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    window: int | None = None
    local_rope: bool = False


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
    # The KV pool's dtype: the activations', or bf16 under fp32 (attention then runs in bf16).
    kv_dtype: torch.dtype
    # Whether the native loop attends a shared prefix itself (a native prefix attention kernel for
    # the head shape); else such steps run per layer.
    shared_prefix: bool = False
    # The Mixture-of-Experts layers' shape (None: dense MLPs only).
    expert_shape: ExpertShape | None = None
    # What the layers run besides Llama's (Gemma's norms and GELU-tanh, OLMoE's full-width q/k
    # norms), and OLMoE's clip_qkv.
    flavor: FusedFlavor = FusedFlavor.LLAMA
    clip: float | None = None

    def __post_init__(self) -> None:
        self.sparse = [layer.experts for layer in self.layers if layer.experts is not None]

    @property
    def quantized(self) -> bool:
        """Whether the linears hold GGUF-quantized weights (else bf16 packed ones)."""
        return isinstance(self.layers[0].linears[0].packed, QuantizedWeight)

    def ready(self) -> bool:
        """Every linear is packed for the native bf16 linear kernel, or every one is quantized
        (checked when the plan is made)."""
        linears = [linear.packed for layer in self.layers for linear in layer.linears]
        return all(isinstance(w, PackedWeight) and w.kernels is not None for w in linears) or all(
            isinstance(w, QuantizedWeight) for w in linears
        )

    def _address(self, linear: ParallelLinear) -> int:
        weight = linear.packed
        if isinstance(weight, QuantizedWeight):
            return int(weight.layout.data_ptr())
        assert weight is not None
        return int(weight.data.data_ptr())

    def pointers(self, attention: AttentionCall) -> torch.Tensor:
        """[layers, 21] int64 (addresses, 0: none): input norm, qkv, qkv bias, o, post-attention
        norm, gate/up, down, K pool, V pool, q norm, k norm, a Mixture-of-Experts layer's router and
        its experts' gate/up and down layout tables, the attention's and the MLP's output norms;
        the window (0: none) and whether the layer takes the local rotary tables; a shared expert's
        gate/up and down layouts and its gate. Read every step: weights are repacked on updates and
        the pool is reallocated after a release."""
        pool = attention.kv_pool
        rows = []
        for index, layer in enumerate(self.layers):
            qkv, o, *mlp = (self._address(linear) for linear in layer.linears)
            gate_up, down = mlp if mlp else (0, 0)
            bias = 0 if layer.qkv_bias is None else layer.qkv_bias.data_ptr()
            k_pool, v_pool = pool.k_buffers[index].data_ptr(), pool.v_buffers[index].data_ptr()
            norms = layer.input_norm.data_ptr(), layer.post_norm.data_ptr()
            qk_norms = [0 if n is None else n.data_ptr() for n in (layer.q_norm, layer.k_norm)]
            moe, shared = [0, 0, 0], [0, 0, 0]
            if layer.experts is not None:
                tables = layer.experts.held.tables(layer.experts.router.shape[0])
                assert tables is not None  # takes() checked
                moe = [layer.experts.router.data_ptr(), tables[0].data_ptr(), tables[1].data_ptr()]
                layouts = layer.experts.held.shared_layouts()
                if layouts is not None:
                    gate = layer.experts.shared_gate
                    shared = [layouts[0].data_ptr(), layouts[1].data_ptr(), gate.data_ptr()]
            out_norms = [0 if n is None else n.data_ptr() for n in (layer.attn_out_norm, layer.mlp_out_norm)]
            window = [layer.window or 0, int(layer.local_rope)]
            row = [norms[0], qkv, bias, o, norms[1], gate_up, down, k_pool, v_pool, *qk_norms, *moe]
            rows.append(row + out_norms + window + shared)
        return torch.tensor(rows, dtype=torch.int64)

    def takes(self, attention: AttentionCall) -> bool:
        """Whether this decode step runs in the native loop (else per layer)."""
        metadata = attention.metadata
        prefix_ok = (
            self.shared_prefix
            or not isinstance(metadata, CpuDecodeMetadata)
            or metadata.shared_prefix is None
        )
        return prefix_ok and all(moe.routed is None and moe.row_invariant for moe in self.sparse)

    def run(
        self, hidden: torch.Tensor, attention: AttentionCall, rope: Rope, local_rope: Rope | None = None
    ) -> torch.Tensor:
        """hidden ([B, hidden] bf16 or fp32) after every decoder layer of a decode step; local_rope:
        the rotation of the layers marked local_rope."""
        metadata = attention.metadata
        if not isinstance(metadata, CpuDecodeMetadata):
            raise TypeError("the fused decode loop runs with the cpu_native attention backend only")
        layout = metadata.layout
        hidden = hidden.contiguous()
        window = None
        if attention.window is not None:
            # The sliding layers' K/V in window slots (cache/swa_pool.py), as planned for them.
            view = attention.window.metadata
            assert isinstance(view, CpuDecodeMetadata)
            rows = view.layout.req_pool_indices
            window = WindowSlots(attention.window.out_cache_loc, view.layout.req_to_token, rows)
        self.kernels.fused_decode(
            self.pointers(attention),
            hidden,
            heads=self.heads,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            intermediate=self.intermediate,
            eps=self.eps,
            scale=self.scale,
            positions=rope.positions,
            cos_table=rope.cos_table,
            sin_table=rope.sin_table,
            out_slots=attention.out_cache_loc,
            req_to_token=layout.req_to_token,
            req_rows=layout.req_pool_indices,
            seq_lens=layout.seq_lens,
            shared_prefix=metadata.shared_prefix,
            quantized=self.quantized,
            kv_dtype=self.kv_dtype,
            experts=self.expert_shape,
            local_tables=None if local_rope is None else (local_rope.cos_table, local_rope.sin_table),
            flavor=self.flavor,
            window_slots=window,
            clip=self.clip,
        )
        return hidden
