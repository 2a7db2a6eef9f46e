"""Batched multi-LoRA on the linear layers: each request of a batch may use its own adapter.

The base matmul runs once for the whole batch; then each row takes its adapter's delta,
scaling · (x Aᵀ) Bᵀ. Each linear keeps the slots' weights (LoraSlots), zero-padded to the pool's
largest rank, so a slot is refilled by a copy and never reallocated. Two ways to apply the
deltas, chosen by the forward's row count and the adapters in use:

- **Stacked** (up to STACKED_MAX_ROWS rows, as in decode steps, or one adapter in use): the A of
  every adapter in use, stacked, in one matmul for all rows; each row's columns of other adapters
  are zeroed by a mask that also carries the scaling; then the stacked Bᵀ in one matmul. A few ops
  per layer, whatever the number of adapters: at a decode step's size the small ops' overhead, not
  their arithmetic, is the cost.
- **Segmented** (more rows and adapters: prefills): rows grouped by adapter, one matmul pair per
  group (the S-LoRA / Punica split), so the arithmetic grows with each adapter's own rows rather
  than with the number of adapters, which the stacked pass multiplies it by.

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
    # The stacked pass: the slots in use, and per row the scaling of its own slot ([rows,
    # len(slots)], zero elsewhere); None for the segmented pass.
    slots: tuple[int, ...] = ()
    scales: torch.Tensor | None = None
    # The segmented pass: per group, its rows' span [start, end) when they are contiguous (the
    # scheduler orders a prefill's requests by adapter), else None.
    spans: list[tuple[int, int] | None] = field(default_factory=list)
    # scales widened to each slot's stacked rank columns, by columns per slot (built once per forward).
    _masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def set(
        self, groups: list[tuple[int, torch.Tensor]], slots: tuple[int, ...], scales: torch.Tensor | None
    ) -> None:
        self.groups, self.slots, self.scales, self._masks = groups, slots, scales, {}
        self.spans = []
        if scales is None:
            for _, rows in groups:
                start, end = int(rows[0]), int(rows[-1]) + 1
                self.spans.append((start, end) if end - start == rows.numel() else None)

    def mask(self, columns_per_slot: int) -> torch.Tensor:
        assert self.scales is not None
        mask = self._masks.get(columns_per_slot)
        if mask is None:
            mask = self._masks[columns_per_slot] = self.scales.repeat_interleave(columns_per_slot, dim=1)
        return mask


class LoraSlots:
    """One linear layer's adapter slots, for its stacked outputs (q, k, v or gate, up, or one).

    Per slot, the outputs' A are kept stacked ([outputs * rank, in]) and their Bᵀ as one block
    matrix ([outputs * rank, all outputs' columns], each output's block in its own columns, zero
    elsewhere), so that one matmul pair gives every output's delta in place."""

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
        self.out_features = out_features
        self.offsets = [sum(out_features[:i]) for i in range(len(out_features))]
        width = len(out_features) * max_rank
        self.a = torch.zeros(slots, width, in_features, dtype=dtype, device=device)
        self.bt = torch.zeros(slots, width, sum(out_features), dtype=dtype, device=device)
        self.scaling = [0.0] * slots
        self.used = [False] * slots
        # The stacked pass's weights for the last set of slots it ran with (decode steps repeat it).
        self._stacked: tuple[tuple[int, ...], torch.Tensor, torch.Tensor] | None = None

    def fill(self, slot: int, output: int, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
        """Puts one adapter's A [rank, in] and B [out, rank] (already this rank's shard) in a slot
        (cleared first: clear())."""
        rank, first = a.shape[0], output * self.max_rank
        self.a[slot, first : first + rank].copy_(a)
        start = self.offsets[output]
        self.bt[slot, first : first + rank, start : start + b.shape[0]].copy_(b.T)
        self.scaling[slot] = scaling
        self.used[slot] = True
        self._stacked = None

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.bt[slot].zero_()
        self.used[slot] = False
        self._stacked = None

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += each row's adapter's delta, in place (y: the layer's output for input x)."""
        if self.rows.scales is not None:
            a, bt = self._stacked_weights()
            hidden = self._down(x, a)
            y.add_(((hidden * self.rows.mask(self.a.shape[1])) @ bt).to(y.dtype))
            return
        for (slot, rows), span in zip(self.rows.groups, self.rows.spans, strict=True):
            if not self.used[slot]:
                continue
            xs = x.index_select(0, rows) if span is None else x[span[0] : span[1]]
            delta = ((self._down(xs, self.a[slot]) @ self.bt[slot]) * self.scaling[slot]).to(y.dtype)
            if span is None:
                y.index_add_(0, rows, delta)
            else:
                y[span[0] : span[1]].add_(delta)

    def _down(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        hidden = x @ a.T
        return all_reduce(hidden, self.ctx) if self.reduce_over_ranks else hidden

    def _stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A and Bᵀ of the slots in use, stacked: [slots in use * outputs * rank, ...]."""
        slots = self.rows.slots
        if self._stacked is None or self._stacked[0] != slots:
            index = torch.tensor(slots, dtype=torch.int64, device=self.a.device)
            a = self.a.index_select(0, index).flatten(0, 1)
            bt = self.bt.index_select(0, index).flatten(0, 1)
            self._stacked = (slots, a, bt)
        return self._stacked[1], self._stacked[2]
