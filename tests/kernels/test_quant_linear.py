"""The quantized-weight matmul (kernels/csrc/quant_linear.cpp, QuantKernels) against dequantize-then-
matmul, for every format, row counts 1-33, odd shapes and both activation modes. The reference
dequantization is gguf's (as transformers') own. scripts/test.sh reruns this for every forced ISA
(the 8- and 16-lane float kernels, vpmaddubsw and vpdpbusd)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve.kernels.cpu_ops import CpuKernels
from radixserve.kernels.native import load_library
from radixserve.kernels.quant_ops import QuantKernels
from radixserve.layers.quantized import KEPT_FORMATS, QuantizedTensor, QuantizedWeight
from tests.kernels.quant_blocks import random_quantized

FORMATS = list(KEPT_FORMATS)
# (rows of W, K): odd column counts (a 4-column tile and its tail), K of 1 to 9 blocks or super-blocks.
SHAPES = {32: [(37, 96), (5, 288)], 256: [(37, 512), (6, 256)]}


@pytest.fixture(scope="module", params=["float", "int8"])
def quant(request: pytest.FixtureRequest, native_kernels: CpuKernels) -> QuantKernels:
    if native_kernels.quant is None:
        pytest.skip(f"no quantized kernel in a build for {native_kernels.isa}")
    return QuantKernels(load_library(), request.param)


def quantize_like_kernel(x: torch.Tensor) -> torch.Tensor:
    """The int8 mode's activations, dequantized: per block of 32, scale max |x| / 127 and values
    rounded half to even (the kernel's arithmetic, in float64 after the fp32 rounding steps)."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    values = torch.round(blocks * inverse)
    return (values.double() * scale.double()).reshape(x.shape)


def reference(mode: str, x: torch.Tensor, weight: QuantizedTensor) -> torch.Tensor:
    dense = weight.dequantize().double()
    activations = quantize_like_kernel(x) if mode == "int8" else x.double()
    return activations @ dense.T


def tolerance(x: torch.Tensor, weight: QuantizedTensor) -> torch.Tensor:
    """fp32 sums of K products: a few fp32 steps of the sum of their magnitudes."""
    return 1e-5 * (x.double().abs() @ weight.dequantize().double().abs().T) + 1e-6


@pytest.mark.parametrize("name", FORMATS)
def test_every_row_count_matches_dequantize_then_matmul(quant: QuantKernels, name: str) -> None:
    block = KEPT_FORMATS[name].block
    for n, k in SHAPES[block]:
        weight = random_quantized(name, n, k, seed=n + k)
        layout = quant.parts_layout([(weight.format.type_id, weight.data)])
        generator = torch.Generator().manual_seed(k)
        x = torch.randn(33, k, generator=generator)
        whole = quant.linear(x, layout, n)
        for rows in range(1, 34):
            got = quant.linear(x[:rows], layout, n)
            # Row-invariant: each row's outputs are the same bits whatever the row count.
            assert torch.equal(got, whole[:rows]), (name, rows)
        error = (whole.double() - reference(quant.activations, x, weight)).abs()
        assert bool((error <= tolerance(x, weight)).all()), (name, n, k, float(error.max()))


@pytest.mark.parametrize("name", FORMATS)
def test_bf16_activations_bias_and_residual(quant: QuantKernels, name: str) -> None:
    block = KEPT_FORMATS[name].block
    n, k = SHAPES[block][0]
    weight = random_quantized(name, n, k, seed=3)
    layout = quant.parts_layout([(weight.format.type_id, weight.data)])
    x = torch.randn(9, k).bfloat16()
    bias, residual = torch.randn(n).bfloat16(), torch.randn(9, n).bfloat16()
    got = quant.linear(x, layout, n, bias, residual)
    assert got.dtype == torch.bfloat16
    exact = reference(quant.activations, x.float(), weight) + bias.double() + residual.double()
    # The fp32 sum, rounded once to bf16.
    torch.testing.assert_close(got.double(), exact, rtol=2**-8, atol=1e-3)


def test_stacked_parts_of_mixed_formats(quant: QuantKernels) -> None:
    """A Q4_K_M file's q/k/v: parts of different formats in one call, with a bias."""
    parts = [
        random_quantized("Q4_K", 7, 256, 1),
        random_quantized("Q6_K", 3, 256, 2),
        random_quantized("Q8_0", 5, 256, 3),
    ]
    weight = QuantizedWeight(parts, quant)
    x, bias = torch.randn(6, 256), torch.randn(15)
    got = weight.matmul(x, bias)
    expected = torch.cat(
        [quant.linear(x, quant.parts_layout([(p.format.type_id, p.data)]), p.rows) for p in parts], 1
    )
    assert torch.equal(got, expected + bias)
    assert torch.equal(weight.to_dense(), torch.cat([p.dequantize() for p in parts]))


@pytest.mark.parametrize("name", FORMATS)
def test_rows_dequantize_as_gguf_does(quant: QuantKernels, name: str) -> None:
    """The embedding lookup of a quantized table."""
    weight = random_quantized(name, 11, 512, seed=5)
    ids = torch.tensor([10, 0, 3, 3, 7])
    got = quant.rows(weight.format.type_id, weight.data, ids, weight.cols)
    torch.testing.assert_close(got, weight.dequantize()[ids], rtol=1e-6, atol=1e-7)


def test_legacy_formats_quantized_by_gguf(quant: QuantKernels) -> None:
    """Blocks from gguf's own quantizer (llama.cpp's reference rounding) of a real-looking weight."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    rng = np.random.default_rng(0)
    dense = rng.standard_normal((24, 192)).astype(np.float32) * 0.05
    x = torch.randn(5, 192)
    for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        fmt = KEPT_FORMATS[name]
        blocks = torch.from_numpy(quantize(dense, GGMLQuantizationType(fmt.type_id)))
        weight = QuantizedTensor(fmt, blocks, 192)
        got = quant.linear(x, quant.parts_layout([(fmt.type_id, blocks)]), 24)
        error = (got.double() - reference(quant.activations, x, weight)).abs()
        assert bool((error <= tolerance(x, weight)).all()), name
