"""Changing and reading the served model's weights in place: named-tensor updates, reads by
checkpoint name, and moving every weight off the device and back (release/resume).

On a bf16 CPU the linear layers hold their weight only in a matmul kernel's packed layout (see
layers/packed_weights.py). Everything here first turns a layer back into a plain weight, works on that, and
packs it again, so callers never see the difference.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from radixserve.distributed.parallel import SINGLE, ParallelContext, gather_shards
from radixserve.layers.linear import (
    ColumnParallelLinear,
    ParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    WeightTarget,
    quantized_storage,
)
from radixserve.layers.packed_weights import WeightPacking
from radixserve.layers.quantized import QuantizedWeight
from radixserve.models.moe import SparseMoE

Packable = ParallelLinear | ParallelLMHead


class ResolvingModel(Protocol):
    def resolve(self, name: str) -> WeightTarget | None: ...

    def modules(self) -> Iterable[nn.Module]: ...


def repack(modules: Iterable[nn.Module], packing: WeightPacking) -> None:
    for module in modules:
        if isinstance(module, (ParallelLinear, ParallelLMHead)):
            module.pack_for_cpu(packing)


def _tied_heads(model: ResolvingModel, changed: list[nn.Module]) -> list[nn.Module]:
    """LM heads that share a weight with a changed module: their packed copy must be redone."""
    weights = {id(p) for m in changed for p in m.parameters()}
    return [m for m in model.modules() if isinstance(m, ParallelLMHead) and id(m.weight) in weights]


def update_weights(
    model: ResolvingModel, named: list[tuple[str, torch.Tensor]], packing: WeightPacking | None
) -> int:
    """Loads checkpoint-named tensors into the model; returns how many were used. All or nothing:
    an unknown name or a wrong shape raises and leaves every weight as it was."""
    targets = [(target, tensor) for name, tensor in named if (target := model.resolve(name)) is not None]
    modules = list({id(t.module): t.module for t, _ in targets}.values())
    tables = [
        t.module_path
        for t, _ in targets
        if isinstance(t.module, VocabParallelEmbedding) and t.module.quant_table is not None
    ]
    if tables:
        raise ValueError(
            f"{', '.join(tables)} holds a GGUF-quantized table, which only a whole checkpoint replaces "
            "(/update_weights_from_disk); linear layers take named tensors (and hold them dense after)"
        )
    modules += [m for m in _tied_heads(model, modules) if m not in modules]
    # A quantized expert an update writes into is a linear of its own, under its layer.
    sparse = [(t.module, t.param) for t, _ in targets if isinstance(t.module, SparseMoE)]
    experts = [e for layer, name in sparse for e in layer.held_linears(name)]
    modules += [e for e in {id(e): e for e in experts}.values() if e not in modules]
    for module in modules:
        if isinstance(module, (ParallelLinear, ParallelLMHead)):
            module.unpack()
    backup = [(p, p.detach().clone()) for m in modules for p in m.parameters(recurse=False)]
    try:
        for target, tensor in targets:
            target.load(tensor)
    except BaseException:
        for param, saved in backup:
            param.data.copy_(saved)
        raise
    finally:
        if packing is not None:
            repack(modules, packing)
    return len(targets)


def read_weight(model: ResolvingModel, name: str) -> torch.Tensor:
    """A weight as the checkpoint names it: a stacked layer gives back only that name's rows. With
    tensor parallelism every rank must call this together: the ranks' shards are gathered."""
    target = model.resolve(name) or model.resolve(name.removeprefix("model."))
    if target is None:
        raise KeyError(
            f"{name} is not stored separately here (tied to another weight, or on another pipeline stage)"
        )
    module = target.module
    if isinstance(module, SparseMoE):
        return module.read(target.param)
    tensor = getattr(module, target.param)
    if isinstance(module, (ParallelLinear, VocabParallelEmbedding)) and target.param == "weight":
        tensor = module.dense_weight()
    if isinstance(module, ColumnParallelLinear):
        tensor = tensor.narrow(0, module.offsets[target.shard], module.local_sizes[target.shard])
    if tensor.numel() == 0:
        raise KeyError(f"{name} is not in memory now (released by /release_memory_occupation)")
    place = _shard_place(target)
    ctx: ParallelContext = getattr(module, "ctx", SINGLE)
    if place is not None and ctx.tp_size > 1:
        tensor = gather_shards(tensor.contiguous(), *place, ctx)
    detached: torch.Tensor = tensor.detach()
    return detached


def _shard_place(target: WeightTarget) -> tuple[int, int, int] | None:
    """(dim, this rank's first index, full size) of a split weight; None for a copied one."""
    module = target.module
    if isinstance(module, ColumnParallelLinear):
        spec = module.shards[target.shard]
        return 0, spec.start, spec.full
    if isinstance(module, RowParallelLinear) and target.param == "weight":
        return 1, module.ctx.tp_rank * module.local_input, module.local_input * module.ctx.tp_size
    if isinstance(module, VocabParallelEmbedding):
        return 0, module.start, module.vocab_size
    return None


class WeightStash:
    """Every weight of a model moved off its device while released. From a GPU they go to host
    memory; on a CPU, host memory is what is to be freed, so they go to a temporary file."""

    def __init__(self, model: nn.Module, device: torch.device, packing: WeightPacking | None):
        self.model = model
        self.device = device
        self.packing = packing
        self.on_host: dict[str, torch.Tensor] = {}
        self.spill_dir: Path | None = None

    def _tensors(self) -> dict[str, torch.Tensor]:
        # Tied weights are one Parameter, listed once; so is a quantized table a tied head shares.
        named = {f"quantized.{i}": data for i, data in enumerate(quantized_storage(self.model))}
        return {**dict(self.model.named_parameters()), **dict(self.model.named_buffers()), **named}

    def release(self) -> None:
        for module in self.model.modules():
            # Quantized weights are stashed as they are, not dequantized.
            if isinstance(module, (ParallelLinear, ParallelLMHead)) and not isinstance(
                module.packed, QuantizedWeight
            ):
                module.unpack()
        tensors = self._tensors()
        if self.device.type == "cpu":
            from safetensors.torch import save_file

            self.spill_dir = Path(tempfile.mkdtemp(prefix="radixserve-weights-"))
            save_file(
                {k: v.detach().contiguous() for k, v in tensors.items()},
                self.spill_dir / "weights.safetensors",
            )
        else:
            self.on_host = {k: v.detach().to("cpu") for k, v in tensors.items()}
        for tensor in tensors.values():
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def resume(self) -> None:
        saved = self.on_host
        if self.spill_dir is not None:
            from safetensors.torch import load_file

            saved = load_file(self.spill_dir / "weights.safetensors")
        for name, tensor in self._tensors().items():
            tensor.data = saved[name].to(self.device)
        for module in self.model.modules():
            if isinstance(packed := getattr(module, "packed", None), QuantizedWeight):
                packed.refresh()
        self.discard()
        if self.packing is not None:
            repack(self.model.modules(), self.packing)

    def discard(self) -> None:
        self.on_host = {}
        if self.spill_dir is not None:
            with contextlib.suppress(OSError):
                shutil.rmtree(self.spill_dir)
            self.spill_dir = None
