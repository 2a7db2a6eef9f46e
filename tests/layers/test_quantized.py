"""Linear layers loading GGUF-quantized shards (layers/linear.py, layers/quantized.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from radixserve.kernels.native import load_library
from radixserve.kernels.quant_ops import QuantKernels
from radixserve.layers.linear import ColumnParallelLinear, quantized_storage
from radixserve.layers.quantized import QuantizationError, QuantizedWeight
from tests.kernels.quant_blocks import quantize_like_kernel, random_quantized


@pytest.fixture(scope="module")
def quant(native_kernels: object) -> QuantKernels:
    kernels = QuantKernels(load_library())
    if not kernels.available:
        pytest.skip("no quantized kernel in this build")
    return kernels


def test_a_stacked_layer_keeps_its_quantized_parts(quant: QuantKernels) -> None:
    parts = [
        random_quantized("Q4_K" if i else "Q8_0", rows, 256, seed=i) for i, rows in enumerate([32, 16, 16])
    ]
    layer = ColumnParallelLinear(256, [32, 16, 16], bias=False)
    for shard, part in enumerate(parts):
        layer.load("weight", part, shard)
    kept = layer.use_quantized(quant)
    # Views of the loaded blocks (with one rank, each shard is the whole tensor): nothing copied.
    assert [p.data.data_ptr() for p in kept] == [p.data.data_ptr() for p in parts]
    assert isinstance(layer.packed, QuantizedWeight) and layer.weight.numel() == 0
    # What a release stashes: the parts as loaded, and as packed for the kernel.
    packed = layer.packed.packed
    assert [t.data_ptr() for t in quantized_storage(layer)] == [
        *(p.data.data_ptr() for p in parts),
        *(t.data_ptr() for t in packed),
    ]
    x = torch.randn(3, 256)
    expected = quantize_like_kernel(x) @ torch.cat([p.dequantize() for p in parts]).double().T
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-4, atol=1e-4)


def test_a_layer_with_a_plain_shard_holds_every_shard_dense(quant: QuantKernels) -> None:
    """A checkpoint whose q and k are quantized but whose v is not: the layer dequantizes the
    quantized shards into its plain weight instead of mixing formats."""
    q, k = random_quantized("Q4_0", 32, 64, seed=1), random_quantized("Q5_1", 16, 64, seed=2)
    v = torch.randn(16, 64)
    layer = ColumnParallelLinear(64, [32, 16, 16], bias=False)
    layer.load("weight", q, 0)
    layer.load("weight", k, 1)
    layer.load("weight", v, 2)
    assert layer.use_quantized(quant) == []
    assert layer.packed is None
    assert torch.equal(layer.weight.data, torch.cat([q.dequantize(), k.dequantize(), v]))


def test_columns_split_only_along_whole_blocks() -> None:
    weight = random_quantized("Q4_K", 4, 512)
    assert weight.narrow_cols(256, 256).shape == (4, 256)
    assert torch.equal(weight.narrow_cols(256, 256).dequantize(), weight.dequantize()[:, 256:])
    with pytest.raises(QuantizationError, match="whole blocks of 256 columns"):
        weight.narrow_cols(128, 384)


def test_a_row_order_reads_permuted_rows_in_place(quant: QuantKernels) -> None:
    """A file that stores rows permuted (llama.cpp's q/k) is read through row_order: the same weight
    as the reordered copy, narrowed, dequantized and multiplied, with no copy of the blocks."""
    stored = random_quantized("Q4_K", 32, 256, seed=3)
    order = torch.randperm(32, generator=torch.Generator().manual_seed(0))
    in_place = replace(stored, row_order=order)
    copied = replace(stored, data=stored.data[order])
    assert torch.equal(in_place.dequantize(), copied.dequantize())
    assert torch.equal(in_place.narrow_rows(8, 16).dequantize(), copied.narrow_rows(8, 16).dequantize())
    assert in_place.narrow_rows(8, 16).data.data_ptr() == stored.data.data_ptr()
    assert in_place.nbytes == stored.nbytes
    layer = ColumnParallelLinear(256, [32], bias=False)
    layer.load("weight", in_place, 0)
    layer.use_quantized(quant)
    x = torch.randn(5, 256)
    expected = quantize_like_kernel(x) @ copied.dequantize().double().T
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-4, atol=1e-4)


def test_all_columns_of_a_mapped_weight_stay_its_view() -> None:
    """One rank takes every column of a row-parallel weight: still the file's view, so its pages
    are released once packed like any other."""
    weight = replace(random_quantized("Q8_0", 4, 64), mapped=True)
    whole = weight.narrow_cols(0, 64)
    assert whole.mapped and whole.data.data_ptr() == weight.data.data_ptr()
    assert not weight.narrow_cols(32, 32).mapped
