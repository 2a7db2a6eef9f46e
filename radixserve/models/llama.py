"""Decoder-only transformer of the Llama family: Llama (incl. llama3 rope), Mistral, Qwen2, Qwen3.

The variants differ only in switches read from ModelConfig: q/k/v bias (Qwen2), per-head q/k
RMSNorm (Qwen3), tied embeddings and rope scaling.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from torch import nn

from radixserve.attention.base import AttentionCall
from radixserve.attention.cpu_native import CpuDecodeMetadata
from radixserve.distributed.parallel import (
    SINGLE,
    ParallelContext,
    all_reduce,
    broadcast_from_last_stage,
    receive_from_previous_stage,
    send_to_next_stage,
    stage_layers,
    start_send_to_next_stage,
)
from radixserve.forward.batch import ForwardBatch, ForwardMode
from radixserve.kernels.cpu_ops import ExpertShape, FusedFlavor
from radixserve.layers.activation import silu_and_mul
from radixserve.layers.linear import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    WeightTarget,
    divide,
    split_evenly,
    split_kv_heads,
)
from radixserve.layers.norm import RMSNorm
from radixserve.layers.quantized import QuantizedWeight, WeightTensor
from radixserve.layers.rotary import Rope, RotaryEmbedding
from radixserve.models.config import ModelConfig
from radixserve.models.fused_decode import FusedDecodePlan, FusedLayer
from radixserve.models.moe import SparseMoE

if TYPE_CHECKING:
    from radixserve.kernels.cpu_ops import CpuKernels


class Attention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        ctx: ParallelContext,
        kernels: CpuKernels | None,
        window: int | None = None,
        norm: type[RMSNorm] = RMSNorm,
    ):
        """layer_id: the layer's place in this stage's KV pool; window: its sliding window (None:
        it sees its whole context); norm: the q/k norms' class (Gemma's scales by 1 + weight)."""
        super().__init__()
        self.layer_id = layer_id
        self.window = window
        self.head_dim = config.head_dim
        self.num_heads = divide(config.num_attention_heads, ctx.tp_size, "num_attention_heads")
        self.scale = config.attention_scale
        q_size = config.num_attention_heads * self.head_dim
        kv = split_kv_heads(config.num_key_value_heads, self.head_dim, ctx)
        self.num_kv_heads = kv.local // self.head_dim
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size, [split_evenly(q_size, ctx), kv, kv], bias=config.attention_bias, ctx=ctx
        )
        self.o_proj = RowParallelLinear(q_size, config.hidden_size, bias=False, ctx=ctx)
        # q/k norms per head (Qwen3), or over each projection's whole width (OLMoE). Their weights
        # are whole on every rank (as every norm's); a tensor-parallel rank scales its own columns.
        self.full_width_norm = config.qk_norm_full_width
        self.ctx = ctx
        self.q_start, self.k_start = ctx.tp_rank * (q_size // ctx.tp_size), kv.start
        q_norm, k_norm = (q_size, kv.full) if self.full_width_norm else (self.head_dim, self.head_dim)
        self.q_norm = norm(q_norm, config.rms_norm_eps, kernels) if config.qk_norm else None
        self.k_norm = norm(k_norm, config.rms_norm_eps, kernels) if config.qk_norm else None
        # OLMoE's clip_qkv: q, k and v clamped to [-clip, clip] after their projection (and norm).
        self.clip = config.clip_qkv

    def forward(
        self, hidden: torch.Tensor, attention: AttentionCall, rope: Rope, residual: torch.Tensor | None
    ) -> torch.Tensor:
        """The attention's output added to residual (if any)."""
        tokens = hidden.shape[0]
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        qkv = self.qkv_proj(hidden)
        v = qkv[:, q_size + kv_size :].view(tokens, self.num_kv_heads, self.head_dim)
        if self.full_width_norm:
            q, k = self._full_width_norms(qkv[:, :q_size], qkv[:, q_size : q_size + kv_size])
            q = q.view(tokens, self.num_heads, self.head_dim)
            k = k.view(tokens, self.num_kv_heads, self.head_dim)
            if self.clip is not None:
                q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
            q, k = rope.rotate_(q), rope.rotate_(k)
        elif self.q_norm is not None and self.k_norm is not None:
            # Rows of one head each: the native RMSNorm's shape, as the fused decode loop runs it.
            q = self.q_norm(qkv[:, :q_size].reshape(-1, self.head_dim)).view(tokens, self.num_heads, -1)
            k = self.k_norm(qkv[:, q_size : q_size + kv_size].reshape(-1, self.head_dim))
            q, k = rope.rotate_(q), rope.rotate_(k.view(tokens, self.num_kv_heads, -1))
        else:
            # Query and key heads are adjacent columns: rotate them together in one pass.
            qk = qkv[:, : q_size + kv_size].view(tokens, self.num_heads + self.num_kv_heads, self.head_dim)
            qk = rope.rotate_(qk)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]

        out = attention(self.layer_id, q, k, v, self.scale, self.window)
        projected: torch.Tensor = self.o_proj(out.reshape(tokens, q_size), residual)
        return projected

    def _full_width_norms(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """OLMoE's RMSNorms over the whole q and k projections. Under tensor parallelism a rank
        holds only its heads' columns: the ranks' sums of squares are added in one all-reduce (for
        q and k together). Every rank holds as many columns of each, and K heads copied to several
        ranks are each held by as many, so the mean square is that sum over tp_size times them."""
        assert self.q_norm is not None and self.k_norm is not None
        if self.ctx.tp_size == 1:
            return self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        q32, k32 = q.float(), k.float()
        sums = all_reduce(torch.stack([q32.square().sum(-1), k32.square().sum(-1)], dim=-1), self.ctx)
        eps = self.q_norm.eps
        normed = []
        for x, x32, sum_sq, norm, start in (
            (q, q32, sums[:, :1], self.q_norm, self.q_start),
            (k, k32, sums[:, 1:], self.k_norm, self.k_start),
        ):
            width = x.shape[-1]
            scaled = x32 * torch.rsqrt(sum_sq / (width * self.ctx.tp_size) + eps)
            normed.append(norm.weight[start : start + width] * scaled.to(x.dtype))
        return normed[0], normed[1]


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, ctx: ParallelContext, kernels: CpuKernels | None):
        super().__init__()
        self.kernels = kernels
        size = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [size, size], bias=False, ctx=ctx)
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=False, ctx=ctx)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The MLP's output added to residual."""
        out: torch.Tensor = self.down_proj(silu_and_mul(self.gate_up_proj(x), self.kernels), residual)
        return out


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        ctx: ParallelContext,
        kernels: CpuKernels | None,
        window: int | None = None,
    ):
        super().__init__()
        self.self_attn = Attention(config, layer_id, ctx, kernels, window)
        sparse = layer_id in config.sparse_layers
        self.mlp: MLP | SparseMoE = SparseMoE(config, ctx, kernels) if sparse else MLP(config, ctx, kernels)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)

    def forward(self, hidden: torch.Tensor, attention: AttentionCall, rope: Rope) -> torch.Tensor:
        hidden = self.self_attn(self.input_layernorm(hidden), attention, rope, residual=hidden)
        out: torch.Tensor = self.mlp(self.post_attention_layernorm(hidden), residual=hidden)
        return out

    def fused_layer(self) -> FusedLayer:
        """This layer's parts as the fused decode loop reads them."""
        attn, mlp = self.self_attn, self.mlp
        dense = (mlp.gate_up_proj, mlp.down_proj) if isinstance(mlp, MLP) else ()
        return FusedLayer(
            input_norm=self.input_layernorm.weight,
            qkv_bias=attn.qkv_proj.bias,
            post_norm=self.post_attention_layernorm.weight,
            linears=(attn.qkv_proj, attn.o_proj, *dense),
            q_norm=None if attn.q_norm is None else attn.q_norm.weight,
            k_norm=None if attn.k_norm is None else attn.k_norm.weight,
            experts=mlp if isinstance(mlp, SparseMoE) else None,
            window=attn.window,
        )


class FusableLayer(Protocol):
    """What fused_decode_plan reads of a family's decoder layer (DecoderLayer, Gemma's)."""

    self_attn: Attention
    mlp: nn.Module
    input_layernorm: RMSNorm

    def fused_layer(self) -> FusedLayer: ...


# checkpoint name → (our module path, shard index within a stacked layer)
_STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_STACKED_NAME = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.")
_LAYER_INDEX = re.compile(r"^layers\.(\d+)\.")
# A Mixture-of-Experts layer's tensor: its router, an expert's linear, a shared expert's, its gate.
_MOE_TENSOR = re.compile(
    r"^layers\.(\d+)\.mlp\.(gate\.weight|experts\.\d+\.(?:gate|up|down)_proj\.weight"
    r"|shared_expert\.(?:gate|up|down)_proj\.weight|shared_expert_gate\.weight)$"
)


class CausalLM(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        max_positions: int,
        ctx: ParallelContext = SINGLE,
        kernels: CpuKernels | None = None,
    ):
        """kernels: the native CPU kernels to use where they apply (None: torch ops only). With
        pipeline parallelism (ctx.pp_size > 1) this rank's stage holds only its layers (keyed by
        their checkpoint index; their KV pool index is their place in the stage), the first
        stage the embedding, the last the final norm and the LM head (and the embedding when tied)."""
        super().__init__()
        self.config = config
        self.kernels = kernels
        self.ctx = ctx
        self.stage = stage_layers(config.num_hidden_layers, ctx)
        # What a stage after the first receives its hidden states in (the model is built in it).
        self.activation_dtype = torch.get_default_dtype()
        self.rotary = RotaryEmbedding(
            config.rotary_dim, max_positions, config.rope_theta, config.rope_scaling
        )
        needs_embedding = ctx.is_first_stage or (ctx.is_last_stage and config.tie_word_embeddings)
        self.embed_tokens = (
            VocabParallelEmbedding(config.vocab_size, config.hidden_size, ctx) if needs_embedding else None
        )
        self.layers = nn.ModuleDict(
            {str(i): self.make_layer(config, local, i, ctx, kernels) for local, i in enumerate(self.stage)}
        )
        self.norm = (
            self.norm_class(config.hidden_size, config.rms_norm_eps, kernels) if ctx.is_last_stage else None
        )
        self.lm_head = (
            ParallelLMHead(config.vocab_size, config.hidden_size, ctx) if ctx.is_last_stage else None
        )
        if self.lm_head is not None and self.embed_tokens is not None and config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # Set by the model runner when decode steps run in the fused native loop (fused_decode_plan).
        self.fused_decode: FusedDecodePlan | None = None
        # pipeline_tick's send of its last output, in flight until the next tick (and the tensor
        # it reads from, kept alive until then).
        self._pending_send: tuple[Any, torch.Tensor] | None = None

    # The final norm's class (a family with another norm overrides it, as make_layer).
    norm_class: type[RMSNorm] = RMSNorm
    # What the fused decode loop runs of a family's layers besides Llama's (Gemma's: norms scaled by
    # 1 + weight, GELU-tanh gating the MLP in place of SiLU).
    fused_flavor = FusedFlavor.LLAMA

    def make_layer(
        self, config: ModelConfig, local: int, index: int, ctx: ParallelContext, kernels: CpuKernels | None
    ) -> nn.Module:
        """Decoder layer `index` (checkpoint numbering), the `local`-th of this stage (its KV pool
        index). Its forward takes (hidden, attention, what rope() returns) and gives the new hidden."""
        return DecoderLayer(config, local, ctx, kernels, config.layer_window(index))

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> Any:
        """The rotation of one forward's positions that each layer takes."""
        return self.rotary.lookup(positions, dtype, self.kernels)

    def fused_ropes(self, rope: Any) -> tuple[Rope, Rope | None]:
        """rope()'s result as the fused decode loop takes it: the rotation of every layer, and that
        of the layers marked local_rope (None: there are none)."""
        return rope, None

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings of ids (the first stage)."""
        assert self.embed_tokens is not None
        out: torch.Tensor = self.embed_tokens(ids)
        return out

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, attention: AttentionCall) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 logits for `batch.sample_rows`, then `batch.logprob_rows` if any; and the normed
        hidden states of those rows, then of `batch.hidden_rows`."""
        return self._logits_everywhere(batch, self.final_hidden(batch, attention))

    @torch.inference_mode()
    def final_hidden(self, batch: ForwardBatch, attention: AttentionCall) -> torch.Tensor:
        """The last layer's normed hidden states for the rows forward() returns logits of (on a
        pipeline stage before the last: a tensor of their shape, to receive them into)."""
        hidden = self._stage_hidden(batch, attention)
        if self.norm is None:
            send_to_next_stage(hidden, self.ctx)
            return self._rows_buffer(batch)
        return self._normed_rows(batch, hidden)

    @torch.inference_mode()
    def pipeline_tick(
        self, mine: tuple[ForwardBatch, AttentionCall] | None, finishing: ForwardBatch | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One tick of micro-batched pipeline parallelism (scheduler/pipeline.py): this stage runs
        `mine`, the micro-batch that reached it (receiving its hidden states from the previous
        stage, which ran it a tick ago), and every rank gets forward()'s result for `finishing`,
        the micro-batch the last stage ran. Either may be None (a bubble). This stage's output goes
        to the next stage without waiting: the next stage takes it at its next tick, after the
        broadcast here and the scheduler's own collectives in between."""
        if self._pending_send is not None:
            self._pending_send[0].wait()  # sent a tick ago; received by now or being received
            self._pending_send = None
        out = None
        if mine is not None:
            batch, attention = mine
            hidden = self._stage_hidden(batch, attention)
            out = hidden if self.norm is None else self._normed_rows(batch, hidden)
        result = None
        if finishing is not None:
            normed = out if out is not None and self.ctx.is_last_stage else self._rows_buffer(finishing)
            result = self._logits_everywhere(finishing, normed)
        if out is not None and not self.ctx.is_last_stage:
            out = out.contiguous()
            self._pending_send = (start_send_to_next_stage(out, self.ctx), out)
        return result

    def _stage_hidden(self, batch: ForwardBatch, attention: AttentionCall) -> torch.Tensor:
        """This stage's layers over the batch: from the embedding on the first stage, else from the
        hidden states the previous stage sent."""
        if self.embed_tokens is None or not self.ctx.is_first_stage:
            shape = (batch.input_ids.shape[0], self.config.hidden_size)
            empty = torch.empty(shape, dtype=self.activation_dtype, device=batch.input_ids.device)
            hidden = receive_from_previous_stage(empty, self.ctx)
        elif batch.input_embeds is None:
            hidden = self.embed(batch.input_ids)
        else:
            # Rows with given vectors carry stand-in ids outside the vocabulary.
            hidden = self.embed(batch.input_ids.clamp(max=self.config.vocab_size - 1))
            for row, vectors in batch.input_embeds:
                hidden[row : row + len(vectors)] = vectors
        rope = self.rope(batch.positions, hidden.dtype)
        fused = self.fused_decode
        # A verify step of chains runs fused too, when the backend planned it as decode rows.
        as_decode = batch.mode is ForwardMode.DECODE or isinstance(attention.metadata, CpuDecodeMetadata)
        if fused is not None and as_decode and fused.takes(attention):
            return fused.run(hidden, attention, *self.fused_ropes(rope))
        for layer in self.layers.values():
            hidden = layer(hidden, attention, rope)
        return hidden

    def _output_rows(self, batch: ForwardBatch) -> torch.Tensor:
        """The rows forward() returns: the sampled ones, then logprob rows, then hidden rows."""
        extra = [r for r in (batch.logprob_rows, batch.hidden_rows) if r is not None]
        return torch.cat([batch.sample_rows, *extra]) if extra else batch.sample_rows

    def _normed_rows(self, batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        # Only the rows that sample need the final norm and the (large) vocabulary projection.
        assert self.norm is not None
        normed: torch.Tensor = self.norm(hidden[self._output_rows(batch)])
        return normed

    def _rows_buffer(self, batch: ForwardBatch) -> torch.Tensor:
        """Where a stage before the last receives the last stage's normed rows of the batch."""
        shape = (self._output_rows(batch).shape[0], self.config.hidden_size)
        return torch.empty(shape, dtype=self.activation_dtype, device=batch.input_ids.device)

    def _logits_everywhere(
        self, batch: ForwardBatch, normed: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """forward()'s result from the normed rows: on every rank the last stage's."""
        with_logits = normed.shape[0] - (0 if batch.hidden_rows is None else len(batch.hidden_rows))
        if self.ctx.pp_size == 1:
            assert self.lm_head is not None
            return self.lm_head.logits(normed[:with_logits]).float(), normed
        # Every rank's scheduler samples from (rank 0) or looks at the same logits: the last stage's.
        logits = torch.empty(with_logits, self.config.vocab_size, dtype=torch.float32, device=normed.device)
        if self.lm_head is not None:
            logits = self.lm_head.logits(normed[:with_logits]).float().contiguous()
        normed = broadcast_from_last_stage(normed.contiguous(), self.ctx)
        return broadcast_from_last_stage(logits, self.ctx), normed

    def fused_decode_plan(self, kv_dtype: torch.dtype) -> FusedDecodePlan | None:
        """This model's layers for the fused native decode loop (models/fused_decode.py) over a KV
        pool of kv_dtype, or None where it cannot run them: no native linear kernel here, tensor
        parallelism, a head shape without a compiled decode attention kernel, a
        pool neither in the activations' dtype nor bf16 under fp32, biases on o_proj/down_proj, a
        linear the native kernel declined, clipped qkv other than OLMoE's in fp32, or
        Mixture-of-Experts layers it cannot run (models/fused_decode.py). Steps whose requests
        share a prefix run in it where a native prefix attention kernel exists for the head shape."""
        kernels, config = self.kernels, self.config
        layers = cast("list[FusableLayer]", list(self.layers.values()))
        first = layers[0]
        attention = first.self_attn
        dtype = first.input_layernorm.weight.dtype
        quantized = isinstance(attention.qkv_proj.packed, QuantizedWeight)
        linear_kernel = quantized or (kernels is not None and kernels.linear_kernel is not None)
        if kernels is None or not linear_kernel:
            return None
        if config.clip_qkv is not None and not (config.qk_norm_full_width and dtype == torch.float32):
            return None  # the layer clamps only after full-width norms (OLMoE's), natively in fp32
        sparse = [layer.mlp for layer in layers if isinstance(layer.mlp, SparseMoE)]
        fusable = quantized and all(self._fusable(moe) for moe in sparse)
        if sparse and not fusable:
            return None
        fused_layers: list[FusedLayer] = [layer.fused_layer() for layer in layers]
        dense = [layer for layer in fused_layers if layer.experts is None]
        if kv_dtype != dtype and (dtype, kv_dtype) != (torch.float32, torch.bfloat16):
            return None
        if attention.o_proj.ctx.tp_size != 1 or not kernels.handles_decode_attention(
            attention.num_heads, attention.num_kv_heads, config.head_dim, kv_dtype
        ):
            return None
        # Biases on o_proj or a dense MLP's down_proj (linears[1] and [3]) have no place in the loop.
        if any(linear.bias is not None for layer in fused_layers for linear in layer.linears[1::2]):
            return None
        down = dense[0].linears[3] if dense else None
        plan = FusedDecodePlan(
            kernels=kernels,
            layers=fused_layers,
            heads=attention.num_heads,
            kv_heads=attention.num_kv_heads,
            head_dim=config.head_dim,
            intermediate=down.local_input if isinstance(down, RowParallelLinear) else 0,
            eps=first.input_layernorm.eps,
            scale=attention.scale,
            kv_dtype=kv_dtype,
            # The prefix attention kernels are bf16 only.
            shared_prefix=kv_dtype == torch.bfloat16
            and kernels.prefix_attention_kernel(attention.num_heads, attention.num_kv_heads, config.head_dim)
            is not None,
            expert_shape=self._expert_shape(sparse[0]) if sparse else None,
            flavor=self.fused_flavor
            | (FusedFlavor.FULL_WIDTH_QK_NORMS if config.qk_norm_full_width else FusedFlavor.LLAMA),
            clip=config.clip_qkv,
        )
        return plan if plan.ready() else None

    @staticmethod
    def _expert_shape(moe: SparseMoE) -> ExpertShape:
        return ExpertShape(moe.router.shape[0], moe.top_k, moe.normalize, moe.size, moe.shared_size)

    @staticmethod
    def _fusable(moe: SparseMoE) -> bool:
        """Whether the fused loop can run this Mixture-of-Experts layer: the calls it makes are
        the row-invariant native ones (fp32, every expert in blocks, a shared one too)."""
        return moe.row_invariant and moe.router.is_contiguous() and moe.shared_gate.is_contiguous()

    def resolve(self, name: str) -> WeightTarget | None:
        """Where a checkpoint tensor goes; None for tensors this model derives itself."""
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None
        if "rotary_emb.inv_freq" in name:
            return None
        path = name.removeprefix("model.")
        # Another pipeline stage's part of the model.
        layer = _LAYER_INDEX.match(path)
        if layer is not None and int(layer.group(1)) not in self.stage:
            if int(layer.group(1)) < self.config.num_hidden_layers:
                return None
            raise KeyError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
        if (
            path.split(".")[0] in ("embed_tokens", "norm", "lm_head")
            and getattr(self, path.split(".")[0]) is None
        ):
            return None
        expert = _MOE_TENSOR.match(path)
        if expert is not None:
            moe = getattr(self.layers[expert.group(1)], "mlp", None)
            if isinstance(moe, SparseMoE):
                return WeightTarget(f"layers.{expert.group(1)}.mlp", moe, expert.group(2), 0)
        shard = 0
        match = _STACKED_NAME.search(path)
        if match:
            stacked, shard = _STACKED[match.group(1)]
            path = path.replace(match.group(1), stacked)
        module_path, _, param = path.rpartition(".")
        module = dict(self.named_modules()).get(module_path)
        if module is None or not hasattr(module, "load"):
            raise KeyError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
        return WeightTarget(module_path, module, param, shard)

    def load_weights(self, weights: Iterable[tuple[str, WeightTensor]]) -> None:
        seen: set[str] = set()
        for name, tensor in weights:
            target = self.resolve(name)
            if target is None:
                continue
            target.load(tensor)
            seen.add(f"{target.module_path}.{target.param}#{target.shard}")
        expected = self._expected_tensors()
        missing = expected - seen
        if missing:
            raise KeyError(f"checkpoint is missing tensors: {sorted(missing)[:8]}")

    def _expected_tensors(self) -> set[str]:
        names = set()
        for module_path, module in self.named_modules():
            if module is self.lm_head and self.config.tie_word_embeddings:
                continue
            if isinstance(module, ColumnParallelLinear):
                shards = range(len(module.local_sizes))
                names |= {f"{module_path}.weight#{s}" for s in shards}
                if module.bias is not None:
                    names |= {f"{module_path}.bias#{s}" for s in shards}
            elif isinstance(module, (RowParallelLinear, VocabParallelEmbedding, RMSNorm)):
                names.add(f"{module_path}.weight#0")
            elif isinstance(module, SparseMoE):
                names |= {f"{module_path}.{n}#0" for n in module.checkpoint_names(self.config)}
        return names
