"""Which format the model runner holds its weights in: a checkpoint's quantized blocks or dense
tensors (decided once, at load), and what they take in memory."""

from __future__ import annotations

import logging

import torch
from torch import nn

from radixserve.config.server_args import InvalidArgumentError
from radixserve.kernels.cpu_ops import CpuKernels
from radixserve.layers.packed_weights import PackedWeight
from radixserve.models.config import ModelConfig
from radixserve.models.source import ModelSource

logger = logging.getLogger(__name__)


def keeps_quantized(
    method: str | None,
    source: ModelSource,
    config: ModelConfig,
    kernels: CpuKernels | None,
    device: torch.device,
) -> bool:
    """Whether the weights load quantized: a GGUF's blocks (unless --quantization none), or a
    safetensors checkpoint under --quantization FORMAT. Both need the native quantized kernel
    (csrc/quant_linear.cpp) on a CPU; asking for what cannot be raises with the reason."""
    gguf = source.kind != "hf_dir"
    kernel = kernels.quant if kernels is not None and device.type == "cpu" else None
    if method == "none" or config.is_encoder:
        return False
    if method is not None:
        if gguf:
            raise InvalidArgumentError(
                f"--quantization {method} quantizes a safetensors checkpoint; {source.path} is a GGUF, "
                "already quantized (serve it as it is, or --quantization none to dequantize it)"
            )
        if kernel is None:
            raise InvalidArgumentError(
                f"--quantization {method} needs the native quantized kernel, which this build lacks "
                f"({_kernel_missing(kernels, device)})"
            )
        return True
    if gguf and kernel is None:
        logger.info("GGUF weights are dequantized: %s", _kernel_missing(kernels, device))
    return gguf and kernel is not None


def _kernel_missing(kernels: CpuKernels | None, device: torch.device) -> str:
    if device.type != "cpu":
        return f"quantized kernels are CPU kernels, the device is {device}"
    if kernels is None:
        return "the native CPU kernels are off (--cpu-kernels torch, or they did not build)"
    return f"the native kernels were built for {kernels.isa}, and it needs AVX2 + FMA + F16C"


def quantized_kernel_name(kernels: CpuKernels) -> str:
    """linear_kernel for quantized weights: quant_int16_<how it multiplies> (QuantKernels.isa)."""
    quant = kernels.quant
    assert quant is not None
    return f"quant_int16_{quant.isa}"


def weight_bytes(model: nn.Module, quantized: dict[str, int]) -> dict[str, int]:
    """Bytes of the model's weights by format: each quantized format (`quantized`, as loaded), and
    the dense tensors (norms, and whatever is not quantized) under their dtype."""
    resident = dict(quantized)
    seen: set[int] = set()
    for module in model.modules():
        tensors: list[torch.Tensor] = [*module.parameters(recurse=False)]
        packed = getattr(module, "packed", None)
        if isinstance(packed, PackedWeight):
            tensors.append(packed.data)
        for tensor in tensors:
            # By identity: a tied weight is one Parameter, and oneDNN's packed tensors have no
            # storage to take an address of.
            if tensor.numel() and id(tensor) not in seen:
                seen.add(id(tensor))
                name = str(tensor.dtype).removeprefix("torch.")
                resident[name] = resident.get(name, 0) + tensor.numel() * tensor.element_size()
    return resident
