"""The model's LoRA adapter pool (--enable-lora): every adapter loaded, in host memory, and
--max-loras-per-batch slots on the device, one adapter each, which the LoRA layers read
(layers/lora.py). The scheduler decides which adapter goes in which slot (scheduler/lora.py); the
pool copies it there, as this rank's shard of each weight."""

from __future__ import annotations

import logging
import os

import torch

from radixserve.distributed.parallel import ParallelContext
from radixserve.layers.linear import ColumnParallelLinear, ParallelLinear, RowParallelLinear
from radixserve.layers.lora import STACKED_MAX_ROWS, LoraRows, LoraSlots
from radixserve.models.config import ModelConfig
from radixserve.models.lora_adapter import LoraAdapter, LoraAdapterError, load_lora_adapter

logger = logging.getLogger("radixserve")
STACKED_ROWS_ENV = "RADIXSERVE_LORA_STACKED_MAX_ROWS"

# Where each PEFT module name lives in a decoder layer: (attribute path, stacked output index).
_MODULE_PLACES: dict[str, tuple[str, str, int]] = {
    "q_proj": ("self_attn", "qkv_proj", 0),
    "k_proj": ("self_attn", "qkv_proj", 1),
    "v_proj": ("self_attn", "qkv_proj", 2),
    "o_proj": ("self_attn", "o_proj", 0),
    "gate_proj": ("mlp", "gate_up_proj", 0),
    "up_proj": ("mlp", "gate_up_proj", 1),
    "down_proj": ("mlp", "down_proj", 0),
}


class LoraPool:
    def __init__(
        self,
        layers: dict[int, torch.nn.Module],
        config: ModelConfig,
        ctx: ParallelContext,
        slots: int,
        max_rank: int,
        target_modules: list[str],
        dtype: torch.dtype,
        device: torch.device,
    ):
        """layers: this rank's decoder layers by checkpoint index (a pipeline stage holds some)."""
        self.config = config
        self.ctx = ctx
        self.max_rank = max_rank
        self.target_modules = frozenset(target_modules)
        self.dtype = dtype
        self.rows = LoraRows()
        # Forward sizes up to which deltas run in the stacked pass (layers/lora.py). Tests force
        # either pass with RADIXSERVE_LORA_STACKED_MAX_ROWS (0: always segmented).
        self.stacked_max_rows = int(os.environ.get(STACKED_ROWS_ENV, STACKED_MAX_ROWS))
        self.adapters: dict[str, LoraAdapter] = {}
        self.slot_names: list[str | None] = [None] * slots
        # (layer, module) -> (the linear, its slots, the stacked output the module is).
        self.places: dict[tuple[int, str], tuple[ParallelLinear, LoraSlots, int]] = {}
        for index, layer in layers.items():
            for module in target_modules:
                block, attr, output = _MODULE_PLACES[module]
                linear = getattr(getattr(layer, block), attr)
                if linear.lora is None:
                    linear.lora = self._slots_for(linear, slots, max_rank, device)
                self.places[(index, module)] = (linear, linear.lora, output)

    def _slots_for(self, linear: ParallelLinear, slots: int, rank: int, device: torch.device) -> LoraSlots:
        if isinstance(linear, ColumnParallelLinear):
            return LoraSlots(
                self.rows, slots, rank, linear.input_size, linear.local_sizes, self.dtype, device, self.ctx
            )
        assert isinstance(linear, RowParallelLinear)
        fan_out = self.config.hidden_size
        return LoraSlots(
            self.rows, slots, rank, linear.local_input, [fan_out], self.dtype, device, self.ctx,
            reduce_over_ranks=self.ctx.tp_size > 1,
        )  # fmt: skip

    def load(self, name: str, path: str) -> LoraAdapter:
        """Reads and checks an adapter into host memory (LoraAdapterError: refused, nothing kept)."""
        if name in self.adapters:
            raise LoraAdapterError(f"a LoRA adapter named {name!r} is loaded already")
        adapter = load_lora_adapter(name, path, self.config, self.max_rank, self.target_modules)
        self.adapters[name] = adapter
        logger.info("LoRA adapter %s loaded from %s (rank %d, %s)", name, path, adapter.rank,
                    ", ".join(sorted(adapter.target_modules)))  # fmt: skip
        return adapter

    def unload(self, name: str) -> None:
        for slot, held in enumerate(self.slot_names):
            if held == name:
                self._clear(slot)
        self.adapters.pop(name, None)

    def set_slot(self, slot: int, name: str) -> None:
        """Copies adapter `name` into a slot (this rank's shard of each of its weights)."""
        adapter = self.adapters[name]
        self._clear(slot)
        for (layer, module), (a, b) in adapter.weights.items():
            place = self.places.get((layer, module))
            if place is None:
                continue  # another pipeline stage's layer
            linear, slots, output = place
            if isinstance(linear, ColumnParallelLinear):
                spec = linear.shards[output]
                b = b.narrow(0, spec.start, spec.local)
            else:
                assert isinstance(linear, RowParallelLinear)
                width = linear.local_input
                a = a.narrow(1, self.ctx.tp_rank * width, width)
            slots.fill(slot, output, a.to(self.dtype), b.to(self.dtype), adapter.scaling)
        self.slot_names[slot] = name

    def set_rows(self, groups: list[tuple[int, torch.Tensor]] | None, num_rows: int) -> None:
        """Which rows of the next forward take which slot's delta (ForwardBatch.lora_groups), and
        for a forward of up to STACKED_MAX_ROWS rows the stacked pass's mask (layers/lora.py)."""
        groups = groups or []
        # One adapter, or few rows: the stacked pass (one adapter's is the segmented one's math).
        if not groups or (num_rows > self.stacked_max_rows and len(groups) > 1):
            self.rows.set(groups, (), None)
            return
        scales = torch.zeros(num_rows, len(groups), dtype=self.dtype, device=groups[0][1].device)
        for column, (slot, indices) in enumerate(groups):
            name = self.slot_names[slot]
            assert name is not None, f"a batch uses LoRA slot {slot}, which holds no adapter"
            scales[indices, column] = self.adapters[name].scaling
        self.rows.set(groups, tuple(slot for slot, _ in groups), scales)

    def _clear(self, slot: int) -> None:
        for _, slots, _ in self.places.values():
            slots.clear(slot)
        self.slot_names[slot] = None
