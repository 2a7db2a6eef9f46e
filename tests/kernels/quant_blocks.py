"""Random GGUF-quantized weights for the quantized-kernel tests: random block bytes with sane fp16
scales, so that every bit pattern of the values, high bits and 6-bit scales occurs (gguf's own
quantizer covers only the legacy formats, and would leave patterns out)."""

from __future__ import annotations

import numpy as np
import torch

from radixserve.layers.quantized import KEPT_FORMATS, QuantizedTensor

# Byte offsets of each format's fp16 fields (scale, and minimum where it has one) within a block.
FP16_FIELDS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}


def random_quantized(name: str, rows: int, cols: int, seed: int = 0) -> QuantizedTensor:
    fmt = KEPT_FORMATS[name]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, cols // fmt.block, fmt.block_bytes), dtype=np.uint8)
    for offset in FP16_FIELDS[name]:
        scales = (
            rng.uniform(0.002, 0.05, size=blocks.shape[:2]) * rng.choice([-1, 1], blocks.shape[:2])
        ).astype(np.float16)
        blocks[:, :, offset : offset + 2] = scales.view(np.uint8).reshape(*blocks.shape[:2], 2)
    data = torch.from_numpy(np.ascontiguousarray(blocks.reshape(rows, -1)))
    return QuantizedTensor(fmt, data, cols)


def quantize_like_kernel(x: torch.Tensor) -> torch.Tensor:
    """The kernel's activations, dequantized: per block of 32, scale max |x| / 32767 and values
    rounded half to even (the kernel's fp32 steps, then float64)."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 32767.0
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    values = torch.round(blocks * inverse)
    return (values.double() * scale.double()).reshape(x.shape)
