"""Batched multi-LoRA on the linear layers: each request of a batch may use its own adapter.

The base matmul runs once for the whole batch; then each row takes its adapter's delta,
scaling · (x Aᵀ) Bᵀ. Each linear keeps the slots' weights stacked ([slots, rank, in] for A and
[slots, rank, out] for Bᵀ), zero-padded to the pool's largest rank, so a slot is refilled by a
copy and never reallocated. Two ways to apply the deltas, chosen by the forward's row count:

- **Stacked** (up to STACKED_MAX_ROWS rows: decode steps): the A of every adapter in use, stacked,
  in one matmul for all rows; each row's columns of other adapters are zeroed by a mask that also
  carries the scaling; then the stacked Bᵀ in one matmul. A few ops per layer, whatever the number
  of adapters: at a decode step's size the small ops' overhead, not their arithmetic, is the cost.
- **Segmented** (more rows: prefills): rows grouped by adapter, one matmul pair per group (the
  S-LoRA / Punica split), so the arithmetic grows with each adapter's own rows rather than with
  the number of adapters, which the stacked pass multiplies it by.

With tensor parallelism: a column-parallel layer (q/k/v, gate/up) holds A whole and the rows of
B for its own output shard; a row-parallel layer (o, down) holds the columns of A for its own
input shard and B whole, and sums x Aᵀ over the ranks (a [tokens, rank] all-reduce) before B.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from radixserve.distributed.parallel import SINGLE, ParallelContext, all_reduce

# Rows up to which the stacked pass runs (a decode step of up to this many requests).
STACKED_MAX_ROWS = 128


@dataclass
class LoraRows:
    """Which rows of the current forward use which adapter slot (rows without one use none).
    One object is shared by every LoRA layer of a model; the pool sets it per forward."""

    groups: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    # The stacked pass: the slots in use, and per row the scaling of its own slot's rank columns
    # ([rows, len(slots) * max_rank], zero elsewhere); None for the segmented pass.
    slots: tuple[int, ...] = ()
    mask: torch.Tensor | None = None


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
        self.max_rank = max_rank
        self.a = [torch.zeros(slots, max_rank, in_features, dtype=dtype, device=device) for _ in out_features]
        self.bt = [torch.zeros(slots, max_rank, out, dtype=dtype, device=device) for out in out_features]
        self.offsets = [sum(out_features[:i]) for i in range(len(out_features))]
        self.scaling = [0.0] * slots
        # The stacked outputs each slot's adapter targets (the others add nothing).
        self.active: list[set[int]] = [set() for _ in range(slots)]
        # The stacked pass's weights for the last set of slots it ran with (decode steps repeat it).
        self._stacked: tuple[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] | None = None

    def fill(self, slot: int, output: int, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
        """Puts one adapter's A [rank, in] and B [out, rank] (already this rank's shard) in a slot."""
        rank = a.shape[0]
        self.a[output][slot].zero_()
        self.bt[output][slot].zero_()
        self.a[output][slot, :rank].copy_(a)
        self.bt[output][slot, :rank].copy_(b.T)
        self.scaling[slot] = scaling
        self.active[slot].add(output)
        self._stacked = None

    def clear(self, slot: int) -> None:
        # Zeroed, not just marked: the stacked pass reads every output of a slot in use.
        for a, bt in zip(self.a, self.bt, strict=True):
            a[slot].zero_()
            bt[slot].zero_()
        self.active[slot] = set()
        self._stacked = None

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += each row's adapter's delta, in place (y: the layer's output for input x)."""
        if self.rows.mask is not None:
            self._add_stacked(x, y, self.rows.mask)
            return
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
                delta = (hidden @ self.bt[output][slot]) * scale
                start = self.offsets[output]
                y[:, start : start + delta.shape[1]].index_add_(0, rows, delta.to(y.dtype))

    def _add_stacked(self, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> None:
        for output, (a, bt) in enumerate(self._stacked_weights()):
            hidden = x @ a.T
            if self.reduce_over_ranks:
                hidden = all_reduce(hidden, self.ctx)
            start = self.offsets[output]
            y[:, start : start + bt.shape[1]].add_(((hidden * mask) @ bt).to(y.dtype))

    def _stacked_weights(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per output, the A [slots in use * rank, in] and Bᵀ [slots in use * rank, out] stacked."""
        slots = self.rows.slots
        if self._stacked is None or self._stacked[0] != slots:
            index = torch.tensor(slots, dtype=torch.int64, device=self.a[0].device)
            weights = [
                (a.index_select(0, index).flatten(0, 1), bt.index_select(0, index).flatten(0, 1))
                for a, bt in zip(self.a, self.bt, strict=True)
            ]
            self._stacked = (slots, weights)
        return self._stacked[1]
