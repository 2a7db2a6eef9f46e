"""Mixture-of-Experts experts held in GGUF blocks (models/moe.py): each such expert's gate_up and
down are a linear of their own, packed once for the native quantized kernel, beside the layer's
stacked dense experts.

An ExpertLinear is a ParallelLinear, so what the engine does with quantized linears covers it
unchanged: the bytes by format at load (use_quantized_weights), release and resume (its blocks
stashed as they are, its kernel layout refreshed), the resident bytes (quantized_storage).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from radixserve.kernels.quant_ops import QuantKernels
from radixserve.layers.linear import ParallelLinear, copy_checked
from radixserve.layers.quantized import QuantizedTensor, QuantizedWeight, WeightTensor


class ExpertLinear(ParallelLinear):
    """One expert's gate_up (its gate rows, then its up rows) or down on this rank: its quantized
    parts, each in its own format, packed for the kernel; dense in the model's dtype once a dense
    tensor replaced a part (as a ParallelLinear's weight is after an update)."""

    def __init__(self, parts: list[QuantizedTensor], kernels: QuantKernels, dtype: torch.dtype):
        super().__init__()
        self.bias = None
        self.count = len(parts)
        self.weight = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
        self.packed = QuantizedWeight(parts, kernels)

    def use_quantized(self, kernels: QuantKernels) -> list[QuantizedTensor]:
        # Packed as it loaded (the layer needs its kernel before the model's linears get theirs);
        # listed so that the bytes by format count it.
        return list(self.packed.parts) if isinstance(self.packed, QuantizedWeight) else []

    def write(self, part: int, tensor: torch.Tensor, what: str) -> None:
        """Part `part` (gate 0, up 1; down: the one part) replaced by a dense tensor."""
        self.unpack()
        rows = self.weight.shape[0] // self.count
        copy_checked(self.weight.data.narrow(0, part * rows, rows), tensor, what)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, None)


class ExpertStore(nn.Module):
    """A sparse layer's experts held as ExpertLinears, by key ("gate_up_3", "down_3",
    "shared_gate_up", "shared_down"), and the parts of those still loading.

    A weight stays quantized when all its parts come quantized; one that takes a dense part is held
    dense in the layer's stacked tensors, its quantized parts dequantized into them."""

    def __init__(self, kernels: QuantKernels | None, dtype: torch.dtype):
        super().__init__()
        self.kernels = kernels
        self.dtype = dtype
        self.linears = nn.ModuleDict()
        # Keys without a linear: each part loaded so far, quantized (None: written dense).
        self.loading: dict[str, dict[int, QuantizedTensor | None]] = {}
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None
        self._tables_generation = -1

    def get(self, key: str) -> ExpertLinear | None:
        if key not in self.linears:
            return None
        linear = self.linears[key]
        assert isinstance(linear, ExpertLinear)
        return linear

    def tables(self, experts: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The kernel's layouts of every expert's gate_up and down ([experts, layout] each) when all
        of them are held in blocks (QuantKernels.moe runs them); None otherwise. Read again only
        after a quantized weight changed: weights released and resumed, or an expert turned dense."""
        if self._tables_generation != QuantizedWeight.generation:
            self._tables = self._read_tables(experts)
            self._tables_generation = QuantizedWeight.generation
        return self._tables

    def shared_layouts(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The kernel's layouts of the shared expert's gate_up and down when both are held in blocks
        (QuantKernels.moe_shared_ runs it); None otherwise."""
        gate_up, down = self.get("shared_gate_up"), self.get("shared_down")
        if gate_up is None or down is None:
            return None
        if isinstance(gate_up.packed, QuantizedWeight) and isinstance(down.packed, QuantizedWeight):
            return gate_up.packed.layout, down.packed.layout
        return None

    def _read_tables(self, experts: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        stacked: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        for expert in range(experts):
            for kind, into in (("gate_up", stacked[0]), ("down", stacked[1])):
                linear = self.get(f"{kind}_{expert}")
                if linear is None or not isinstance(linear.packed, QuantizedWeight):
                    return None
                into.append(linear.packed.layout)
        return torch.stack(stacked[0]), torch.stack(stacked[1])

    def take(
        self,
        key: str,
        part: int,
        count: int,
        piece: WeightTensor,
        dense: Callable[[int], torch.Tensor],
        what: str,
    ) -> bool:
        """Part `part` of `count` of weight `key`: this rank's piece of it. `dense(p)`: where part p
        goes in the stacked dense tensors. True when this made the weight an ExpertLinear."""
        if isinstance(piece, QuantizedTensor) and self.kernels is None:
            piece = piece.dequantize()  # no quantized kernel here: held dense
        held = self.get(key)
        if held is not None:
            held.write(part, piece.dequantize() if isinstance(piece, QuantizedTensor) else piece, what)
            return False
        parts = self.loading.setdefault(key, {})
        if isinstance(piece, QuantizedTensor):
            parts[part] = piece
        else:
            copy_checked(dense(part), piece, what)
            parts[part] = None
        if any(p is None for p in parts.values()):
            for index, quantized in parts.items():
                if quantized is not None:
                    copy_checked(dense(index), quantized.dequantize(), what)
                    parts[index] = None
            return False
        if len(parts) < count:
            return False
        assert self.kernels is not None
        stacked = [q for _, q in sorted(parts.items()) if q is not None]
        self.linears[key] = ExpertLinear(stacked, self.kernels, self.dtype)
        del self.loading[key]
        return True
