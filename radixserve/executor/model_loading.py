"""A model built on its device with a checkpoint's weights streamed in, held the way the runner's
kernels read them: a GGUF's blocks kept (or --quantization applied), bf16 linears packed for a CPU
matmul kernel, fp32 decode-sized linears on the native kernels. A vision-language checkpoint's
vision tower and projector load apart, once the text model has its tensors.

ModelRunner (model_runner.py) loads once at startup, and again for /update_weights_from_disk
(another checkpoint of the same shapes, built beside the old model so a failure keeps it serving).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from radixserve.distributed.parallel import ParallelContext
from radixserve.kernels.cpu_ops import CpuKernels
from radixserve.layers.linear import use_native_fp32_linears, use_quantized_weights
from radixserve.layers.packed_weights import WeightPacking
from radixserve.layers.quantized import WeightTensor
from radixserve.models.bert import Encoder
from radixserve.models.config import ModelConfig
from radixserve.models.heap import release_freed_heap
from radixserve.models.llama import CausalLM
from radixserve.models.loader import iter_weights, quantize_linears
from radixserve.models.registry import build_model
from radixserve.models.source import ModelSource, release_gguf_readers
from radixserve.models.vision import VisionTower
from radixserve.models.weight_updates import repack

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WeightLayout:
    """How the runner holds its weights, decided once at startup (model_runner.py)."""

    dtype: torch.dtype
    device: torch.device
    kernels: CpuKernels | None
    # Whether linears keep quantized blocks: a GGUF's, or those of `quantization` (--quantization,
    # a GGUF format name) applied to a dense checkpoint as it streams in.
    quantized: bool
    quantization: str | None
    # bf16 linears on a CPU, packed for a matmul kernel (layers/packed_weights.py); None: unpacked.
    packing: WeightPacking | None
    # fp32 on a CPU with the native kernels: decode-sized linears run on csrc/fp32_linear.cpp.
    native_fp32_linears: bool


@dataclass(frozen=True)
class LoadedModel:
    model: CausalLM | Encoder
    vision: VisionTower | None
    # Resident bytes of the quantized weights by format (GGUF type names); empty when none are.
    quantized_bytes: dict[str, int]


def load_model(
    source: ModelSource,
    config: ModelConfig,
    context_len: int,
    parallel: ParallelContext,
    layout: WeightLayout,
) -> LoadedModel:
    """This rank's shard of the model, in eval mode, with the checkpoint's weights."""
    with _default_dtype(layout.dtype), torch.device(layout.device):
        model = build_model(config, context_len, parallel, layout.kernels)
    # The vision tower's tensors ("vision.*", models/loader.py) are set aside while the text model
    # streams the rest.
    vision_weights: list[tuple[str, torch.Tensor]] = []
    if isinstance(model, Encoder):
        model.load_weights(iter_weights(source, config))
    else:
        weights = iter_weights(source, config, keep_quantized=layout.quantized)
        if layout.quantized and layout.quantization is not None:
            weights = quantize_linears(weights, layout.quantization)
        model.load_weights(_diverting(weights, "vision.", vision_weights))
    vision = _load_vision(config, vision_weights, layout)
    quantized_bytes: dict[str, int] = {}
    if layout.quantized:
        assert layout.kernels is not None and layout.kernels.quant is not None
        quantized_bytes = use_quantized_weights(model, layout.kernels.quant)
        logger.info(
            "quantized weights (%s kernel): %s",
            layout.kernels.quant.isa,
            ", ".join(f"{name} {size / 2**20:.1f} MiB" for name, size in sorted(quantized_bytes.items())),
        )
    if layout.packing is not None:
        repack(model.modules(), layout.packing)
    if layout.native_fp32_linears:
        assert layout.kernels is not None
        use_native_fp32_linears(model, layout.kernels)
    release_gguf_readers()  # the weights keep the file's mapping; its parsed metadata can go
    release_freed_heap()  # what converting and packing the weights freed
    return LoadedModel(model.eval(), vision, quantized_bytes)


def _load_vision(
    config: ModelConfig, weights: list[tuple[str, torch.Tensor]], layout: WeightLayout
) -> VisionTower | None:
    """A vision-language model's vision tower and projector (replicated on every rank: each
    rank's scheduler encodes its requests' images itself)."""
    if config.vision is None:
        return None
    with _default_dtype(layout.dtype), torch.device(layout.device):
        tower = VisionTower(config.vision)
    tower.load_weights(weights)
    return tower.eval()


def _diverting(
    weights: Iterator[tuple[str, WeightTensor]], prefix: str, into: list[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, WeightTensor]]:
    """weights without those named prefix* (never quantized), which go to `into` (without the prefix)."""
    for name, tensor in weights:
        if name.startswith(prefix) and isinstance(tensor, torch.Tensor):
            into.append((name.removeprefix(prefix), tensor))
        else:
            yield name, tensor


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """torch's default dtype inside the block (a module's parameters are created in it), restored
    after it, even when building fails."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
