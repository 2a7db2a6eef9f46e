"""Batched multi-LoRA on the linear layers: each request of a batch may use its own adapter.

The base matmul runs once for the whole batch. Then, per adapter slot in use, the rows of the
requests using it take y[rows] += scaling * (x[rows] A^T) B^T, segment-wise (the S-LoRA / Punica
split: rows grouped by adapter, one small matmul pair per group). Each linear keeps the slots'
weights stacked ([slots, rank, in] and [slots, out, rank]), zero-padded to the pool's largest
rank, so a slot is refilled by a copy and never reallocated.

With tensor parallelism: a column-parallel layer (q/k/v, gate/up) holds A whole and the rows of
B for its own output shard; a row-parallel layer (o, down) holds the columns of A for its own
input shard and B whole, and sums x A^T over the ranks (a [tokens, rank] all-reduce) before B.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from radixserve.distributed.parallel import SINGLE, ParallelContext, all_reduce


@dataclass
class LoraRows:
    """Which rows of the current forward use which adapter slot (rows without one are absent).
    One object is shared by every LoRA layer of a model; the runner sets `groups` per forward."""

    groups: list[tuple[int, torch.Tensor]] = field(default_factory=list)


class LoraSlots:
    """One linear layer's adapter slots, for its stacked outputs (q, k, v or gate, up, or one)."""

    def __init__(
        self,
        rows: LoraRows,
        slots: int,
        max_rank: int,
        in_features: int,
        out_features: list[int],
        dtype: torch.dtype,
        device: torch.device,
        ctx: ParallelContext = SINGLE,
        reduce_over_ranks: bool = False,
    ):
        """in_features / out_features: this rank's. reduce_over_ranks: a row-parallel layer, whose
        x holds only this rank's input columns."""
        self.rows = rows
        self.ctx = ctx
        self.reduce_over_ranks = reduce_over_ranks
        self.a = [torch.zeros(slots, max_rank, in_features, dtype=dtype, device=device) for _ in out_features]
        self.b = [torch.zeros(slots, out, max_rank, dtype=dtype, device=device) for out in out_features]
        self.offsets = [sum(out_features[:i]) for i in range(len(out_features))]
        self.scaling = [0.0] * slots
        # The stacked outputs each slot's adapter targets (the others add nothing).
        self.active: list[set[int]] = [set() for _ in range(slots)]

    def fill(self, slot: int, output: int, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
        """Puts one adapter's A [rank, in] and B [out, rank] (already this rank's shard) in a slot."""
        rank = a.shape[0]
        self.a[output][slot].zero_()
        self.b[output][slot].zero_()
        self.a[output][slot, :rank].copy_(a)
        self.b[output][slot, :, :rank].copy_(b)
        self.scaling[slot] = scaling
        self.active[slot].add(output)

    def clear(self, slot: int) -> None:
        self.active[slot] = set()

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += each row's adapter's delta, in place (y: the layer's output for input x)."""
        for slot, rows in self.rows.groups:
            outputs = self.active[slot]
            if not outputs:
                continue
            xs = x.index_select(0, rows)
            scale = self.scaling[slot]
            for output in outputs:
                hidden = xs @ self.a[output][slot].T
                if self.reduce_over_ranks:
                    hidden = all_reduce(hidden, self.ctx)
                delta = (hidden @ self.b[output][slot].T) * scale
                width = delta.shape[1]
                start = self.offsets[output]
                y[:, start : start + width].index_add_(0, rows, delta.to(y.dtype))
