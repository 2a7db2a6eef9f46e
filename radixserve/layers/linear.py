"""Tensor-parallel linear layers, the vocabulary embedding and the LM head.

Each parallel layer holds only its own shard of the weight and knows how to cut that shard out of
a full checkpoint tensor (`load`). With tp_size == 1 the shard is the whole tensor and the
collectives (distributed/parallel.py) do nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.distributed.parallel import SINGLE, ParallelContext, all_reduce, gather_last_dim
from radixserve.layers.quantized import QuantizedTensor, QuantizedWeight, WeightTensor

if TYPE_CHECKING:
    from radixserve.kernels.cpu_ops import CpuKernels
    from radixserve.kernels.quant_ops import QuantKernels
    from radixserve.layers.lora import LoraSlots
    from radixserve.layers.packed_weights import PackedWeight, WeightPacking

# fp32 on a CPU with the native kernels: up to this many rows (a decode step's) run on
# csrc/fp32_linear.cpp, which streams the weights faster than F.linear; more rows on F.linear,
# whose blocked GEMM reuses each weight across rows.
FP32_NATIVE_MAX_ROWS = 16


def fp32_matmul(
    kernels: CpuKernels | None, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    if kernels is not None and x.dim() == 2 and x.shape[0] <= FP32_NATIVE_MAX_ROWS:
        return kernels.fp32_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def use_native_fp32_linears(model: nn.Module, kernels: CpuKernels) -> int:
    """Routes the model's fp32 linears and LM head through fp32_matmul; returns how many. Chosen
    once, where the model is loaded."""
    layers = [m for m in model.modules() if isinstance(m, (ParallelLinear, ParallelLMHead))]
    for layer in layers:
        layer.fp32_kernels = kernels
    return len(layers)


def use_quantized_weights(model: nn.Module, kernels: QuantKernels) -> dict[str, int]:
    """Gives the layers that loaded GGUF-quantized weights their native kernel (an LM head tied to
    a quantized embedding shares its table); returns the resident bytes of quantized weights by
    format. Called once the weights are loaded."""
    modules = list(model.modules())
    tables = {
        id(m.weight): m.quant_table
        for m in modules
        if isinstance(m, VocabParallelEmbedding) and m.quant_table is not None
    }
    for module in modules:
        if isinstance(module, ParallelLMHead) and module.quant_table is None:
            module.quant_table = tables.get(id(module.weight))
    parts = {
        id(part): part
        for module in modules
        if isinstance(module, (ParallelLinear, VocabParallelEmbedding))
        for part in module.use_quantized(kernels)
    }
    resident: dict[str, int] = {}
    for part in parts.values():  # a tied head's table once
        resident[part.format.name] = resident.get(part.format.name, 0) + part.nbytes
    return resident


def quantized_storage(model: nn.Module) -> list[torch.Tensor]:
    """The storage of every GGUF-quantized tensor the model holds in memory (linears' parts as
    loaded and as packed for the kernel, embedding tables), each once (a tied head shares its
    embedding's). Views of a mapped file are not listed: the file holds them."""
    found: dict[int, torch.Tensor] = {}
    for module in model.modules():
        packed = getattr(module, "packed", None)
        quantized = packed if isinstance(packed, QuantizedWeight) else None
        parts = list(quantized.parts) if quantized else []
        table = getattr(module, "quant_table", None)
        for part in [*parts, *([table] if isinstance(table, QuantizedTensor) else [])]:
            if not part.mapped:
                found.setdefault(id(part.data), part.data)
        for data in quantized.packed if quantized else []:
            found.setdefault(id(data), data)
    return list(found.values())


class ShardingError(ValueError):
    """The model's shapes cannot be split over --tp-size ranks."""


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ShardingError(f"{what} ({numerator}) is not divisible by --tp-size ({denominator})")
    return numerator // denominator


@dataclass(frozen=True)
class OutputShard:
    """Rows [start, start + local) of a logical matrix of `full` rows live on this rank."""

    full: int
    local: int
    start: int


def split_evenly(full: int, ctx: ParallelContext, what: str = "output size") -> OutputShard:
    local = divide(full, ctx.tp_size, what)
    return OutputShard(full, local, ctx.tp_rank * local)


def split_kv_heads(num_kv_heads: int, head_dim: int, ctx: ParallelContext) -> OutputShard:
    """K/V heads are split like the query heads; with fewer KV heads than ranks, each rank keeps
    a copy of the one KV head its query heads attend with."""
    if num_kv_heads >= ctx.tp_size:
        local_heads = divide(num_kv_heads, ctx.tp_size, "num_key_value_heads")
        first = ctx.tp_rank * local_heads
    else:
        if ctx.tp_size % num_kv_heads:
            raise ShardingError(
                f"--tp-size ({ctx.tp_size}) must be a multiple of num_key_value_heads ({num_kv_heads}) "
                "when it is larger"
            )
        local_heads, first = 1, ctx.tp_rank * num_kv_heads // ctx.tp_size
    return OutputShard(num_kv_heads * head_dim, local_heads * head_dim, first * head_dim)


def copy_checked(target: torch.Tensor, source: torch.Tensor, what: str) -> None:
    """copy_ would broadcast a wrongly shaped tensor into place; a weight must match exactly."""
    if tuple(target.shape) != tuple(source.shape):
        raise ValueError(f"{what}: expected shape {tuple(target.shape)}, got {tuple(source.shape)}")
    target.copy_(source)


@dataclass
class WeightTarget:
    """Where one checkpoint tensor is loaded: a module, its parameter, and the stacked shard."""

    module_path: str
    module: nn.Module
    param: str
    shard: int

    def load(self, tensor: WeightTensor) -> None:
        self.module.load(self.param, tensor, self.shard)  # type: ignore[operator]


class ParallelLinear(nn.Module):
    """Shared matmul of the linear layers, with an optional packed weight for bf16 on a CPU
    (layers/packed_weights.py; fp32 gains nothing from packing, so it is not packed), or GGUF
    blocks kept quantized (layers/quantized.py)."""

    weight: nn.Parameter
    bias: nn.Parameter | None
    packed: PackedWeight | QuantizedWeight | None = None
    # Set by use_native_fp32_linears for an fp32 model on a CPU.
    fp32_kernels: CpuKernels | None = None
    # --enable-lora: the adapter slots whose deltas each request's rows take (layers/lora.py).
    lora: LoraSlots | None = None

    def __init__(self) -> None:
        super().__init__()
        # GGUF-quantized shards as loaded, by shard index (use_quantized turns them into `packed`).
        self.quant_parts: dict[int, QuantizedTensor] = {}

    def pack_for_cpu(self, packing: WeightPacking) -> None:
        if isinstance(self.packed, QuantizedWeight):
            return  # quantized weights are already in their kernel's layout
        self.packed = packing.pack(self.weight.data)
        # The packed copy replaces the plain one; keep memory at one copy of the weights.
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def dense_weight(self) -> torch.Tensor:
        return self.weight.data if self.packed is None else self.packed.to_dense().to(self.weight.dtype)

    def unpack(self) -> None:
        """Back to a plain weight, which loading and reading need; pack_for_cpu() packs again (a
        quantized weight comes back dense, in the model's dtype)."""
        if self.packed is not None:
            if isinstance(self.packed, QuantizedWeight):
                QuantizedWeight.generation += 1
            self.weight = nn.Parameter(self.dense_weight(), requires_grad=False)
            self.packed = None

    def _shard_rows(self) -> list[tuple[int, int]]:
        """(first row, rows) of each shard of the weight on this rank."""
        return [(0, self.weight.shape[0])]

    def _keep_quantized(self, shard: int, part: QuantizedTensor | None) -> None:
        """Records a quantized shard (None: the shard was loaded as a plain tensor)."""
        if part is None:
            self.quant_parts.pop(shard, None)
        else:
            self.quant_parts[shard] = part

    def use_quantized(self, kernels: QuantKernels) -> list[QuantizedTensor]:
        """The quantized shards become the layer's weight, for the native kernel; a layer whose
        other shards loaded as plain tensors holds them all dequantized instead. Returns the parts
        kept quantized."""
        parts, self.quant_parts = self.quant_parts, {}
        if not parts:
            return []
        shard_rows = self._shard_rows()
        if len(parts) < len(shard_rows):
            for shard, part in parts.items():
                first, rows = shard_rows[shard]
                self.weight.data.narrow(0, first, rows).copy_(part.dequantize())
            return []
        # The parts stay apart (one kernel call takes them all): a GGUF's are views of the mapped file.
        stacked = [parts[shard] for shard in sorted(parts)]
        self.packed = QuantizedWeight(stacked, kernels)
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)
        return stacked

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed is not None:
            return self.packed.matmul(x, bias)
        return fp32_matmul(self.fp32_kernels, x, self.weight, bias)


class ColumnParallelLinear(ParallelLinear):
    """y = x W^T + b with W split by output rows across ranks.

    `outputs` lists the logical sub-matrices stacked in this layer (q, k, v or gate, up), so that
    each is sharded separately and loaded by shard id: a size is split evenly over the ranks, an
    OutputShard says which rows this rank keeps.
    """

    def __init__(
        self,
        input_size: int,
        outputs: Sequence[int | OutputShard],
        bias: bool,
        ctx: ParallelContext = SINGLE,
    ):
        super().__init__()
        self.ctx = ctx
        self.input_size = input_size
        self.shards = [o if isinstance(o, OutputShard) else split_evenly(o, ctx) for o in outputs]
        self.local_sizes = [s.local for s in self.shards]
        self.offsets = [sum(self.local_sizes[:i]) for i in range(len(self.local_sizes))]
        out = sum(self.local_sizes)
        self.weight = nn.Parameter(torch.empty(out, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out), requires_grad=False) if bias else None

    def load(self, name: str, tensor: WeightTensor, shard: int = 0) -> None:
        target = self.weight if name == "weight" else self.bias
        if target is None:
            raise ValueError(f"this layer has no {name}")
        spec = self.shards[shard]
        if tensor.shape[0] != spec.full:
            raise ValueError(f"{name} shard {shard}: expected {spec.full} rows, got {tensor.shape[0]}")
        if isinstance(tensor, QuantizedTensor):
            if name != "weight" or tensor.cols != self.input_size:
                raise ValueError(
                    f"{name} shard {shard}: expected [{spec.full}, {self.input_size}], got {tensor.shape}"
                )
            self._keep_quantized(shard, tensor.narrow_rows(spec.start, spec.local))
            return
        if name == "weight":
            self._keep_quantized(shard, None)
        piece = tensor.narrow(0, spec.start, spec.local)
        copy_checked(target.data.narrow(0, self.offsets[shard], spec.local), piece, f"{name} shard {shard}")

    def _shard_rows(self) -> list[tuple[int, int]]:
        return list(zip(self.offsets, self.local_sizes, strict=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, self.bias)
        if self.lora is not None:
            self.lora.add_to(x, y)
        return y


class RowParallelLinear(ParallelLinear):
    """y = x W^T with W split by input columns; the partial sums are all-reduced across ranks."""

    def __init__(self, input_size: int, output_size: int, bias: bool, ctx: ParallelContext = SINGLE):
        super().__init__()
        self.ctx = ctx
        self.local_input = divide(input_size, ctx.tp_size, "input size")
        self.weight = nn.Parameter(torch.empty(output_size, self.local_input), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None

    def load(self, name: str, tensor: WeightTensor, shard: int = 0) -> None:
        if name == "bias":
            assert self.bias is not None and isinstance(tensor, torch.Tensor)
            copy_checked(self.bias.data, tensor, "bias")
            return
        if len(tensor.shape) != 2 or tensor.shape[1] != self.local_input * self.ctx.tp_size:
            raise ValueError(
                f"weight: expected {self.local_input * self.ctx.tp_size} columns, got {tuple(tensor.shape)}"
            )
        if isinstance(tensor, QuantizedTensor):
            if tensor.rows != self.weight.shape[0]:
                raise ValueError(f"weight: expected {self.weight.shape[0]} rows, got {tensor.rows}")
            # A shard along whole blocks only (QuantizationError says so otherwise).
            self._keep_quantized(0, tensor.narrow_cols(self.ctx.tp_rank * self.local_input, self.local_input))
            return
        self._keep_quantized(0, None)
        piece = tensor.narrow(1, self.ctx.tp_rank * self.local_input, self.local_input)
        copy_checked(self.weight.data, piece, "weight")

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T (+ bias) (+ residual).

        A packed weight adds the residual in the matmul's epilogue, on the fp32 accumulator before
        rounding: one pass less, and closer to the fp32 result (measured against fp32 logits:
        docs/architecture.md). A fused SiLU-and-multiply epilogue for gate/up was faster but less
        accurate, so it is not used."""
        if residual is not None and self.packed is not None and self.bias is None and self.ctx.tp_size == 1:
            out = self.packed.matmul(x, None, residual)
            if self.lora is not None:
                self.lora.add_to(x, out)
            return out
        # The bias is added once, after the reduction, so that it is not counted tp_size times.
        y = all_reduce(self.matmul(x, None), self.ctx)
        if self.bias is not None:
            y = y + self.bias
        if self.lora is not None:
            self.lora.add_to(x, y)  # before the residual, in the order transformers + peft add them
        return y if residual is None else residual + y


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows; each rank looks up the ids it owns."""

    def __init__(self, vocab_size: int, hidden_size: int, ctx: ParallelContext = SINGLE):
        super().__init__()
        self.ctx = ctx
        self.vocab_size = vocab_size
        self.vocab_per_rank = math.ceil(vocab_size / ctx.tp_size)
        self.start = ctx.tp_rank * self.vocab_per_rank
        self.end = min(vocab_size, self.start + self.vocab_per_rank)
        self.weight = nn.Parameter(torch.empty(self.end - self.start, hidden_size), requires_grad=False)
        # A GGUF-quantized table as loaded, and the kernel its lookups run on once use_quantized has run.
        self.quant_table: QuantizedTensor | None = None
        self.quant_kernels: QuantKernels | None = None

    def load(self, name: str, tensor: WeightTensor, shard: int = 0) -> None:
        if isinstance(tensor, QuantizedTensor):
            if tensor.shape != (self.vocab_size, self.weight.shape[1]):
                raise ValueError(
                    f"embedding: expected {(self.vocab_size, self.weight.shape[1])}, got {tensor.shape}"
                )
            self.quant_table = tensor.narrow_rows(self.start, self.end - self.start)
            return
        self.quant_table = self.quant_kernels = None
        copy_checked(self.weight.data, tensor[self.start : self.end], "embedding")

    def use_quantized(self, kernels: QuantKernels) -> list[QuantizedTensor]:
        if self.quant_table is None:
            return []
        self.quant_kernels = kernels
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)
        return [self.quant_table]

    def dense_weight(self) -> torch.Tensor:
        if self.quant_table is not None:
            return self.quant_table.dequantize().to(self.weight.dtype)
        return self.weight.data

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        table = self.quant_table
        if table is not None and self.quant_kernels is not None:
            # Only the rows read are dequantized.
            flat = ids.reshape(-1) if table.row_order is None else table.row_order[ids.reshape(-1)]
            rows = self.quant_kernels.rows(table.format.type_id, table.data, flat, table.cols)
            return rows.to(self.weight.dtype).reshape(*ids.shape, table.cols)
        return F.embedding(ids, self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.ctx.tp_size == 1:
            return self._lookup(ids)
        owned = (ids >= self.start) & (ids < self.end)
        local = torch.where(owned, ids - self.start, torch.zeros_like(ids))
        out = self._lookup(local) * owned.unsqueeze(-1)
        return all_reduce(out, self.ctx)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection sharing the vocab split of the embedding (and its weight when tied)."""

    packed: PackedWeight | QuantizedWeight | None = None
    fp32_kernels: CpuKernels | None = None

    def pack_for_cpu(self, packing: WeightPacking) -> None:
        if isinstance(self.packed, QuantizedWeight):
            return
        # A separate packed copy: with tied embeddings the plain weight still serves the lookups.
        self.packed = packing.pack(self.weight.data)

    def unpack(self) -> None:
        if not isinstance(self.packed, QuantizedWeight):
            self.packed = None

    def use_quantized(self, kernels: QuantKernels) -> list[QuantizedTensor]:
        """The head multiplies with its quantized table (its own, or a tied embedding's)."""
        if self.quant_table is None:
            return []
        self.packed = QuantizedWeight([self.quant_table], kernels)
        return super().use_quantized(kernels)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            out = self.packed.matmul(hidden)
        else:
            out = fp32_matmul(self.fp32_kernels, hidden, self.weight)
        # Every rank gets the whole vocabulary's logits, so every rank takes the same decisions.
        return gather_last_dim(out, self.vocab_size, self.ctx)
