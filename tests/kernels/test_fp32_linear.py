"""The fp32 matmul for decode-sized row counts (kernels/csrc/fp32_linear.cpp, CpuKernels.fp32_linear)
and the layers' choice between it and F.linear (layers/linear.py fp32_matmul).

Checked against an fp64 reference within fp32 accumulation error, for every shape class the kernel
splits k into (steps of 32, of 8, a scalar tail); and row by row the same bits whatever the row
count, as the kernel documents. scripts/test.sh reruns this for every forced ISA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixserve.kernels.cpu_ops import CpuKernels
from radixserve.layers.linear import FP32_NATIVE_MAX_ROWS, fp32_matmul


@pytest.mark.parametrize(
    ("rows", "n", "k"),
    [(1, 1536, 576), (3, 576, 1536), (16, 200, 37), (5, 17, 1000), (2, 9, 8), (1, 3, 5), (4, 64, 40)],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp32_linear_matches_fp64(
    native_kernels: CpuKernels, rows: int, n: int, k: int, with_bias: bool
) -> None:
    torch.manual_seed(rows * 1000 + n + k)
    x, weight = torch.randn(rows, k), torch.randn(n, k)
    bias = torch.randn(n) if with_bias else None
    got = native_kernels.fp32_linear(x, weight, bias)
    exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    # fp32 sums of k products of unit normals: errors grow like sqrt(k) ulps of the sum.
    torch.testing.assert_close(got.double(), exact, atol=2e-6 * k**0.5 * 4, rtol=0)


def test_each_row_has_the_same_bits_whatever_the_row_count(native_kernels: CpuKernels) -> None:
    torch.manual_seed(3)
    x, weight, bias = torch.randn(16, 300), torch.randn(130, 300), torch.randn(130)
    together = native_kernels.fp32_linear(x, weight, bias)
    for row in range(16):
        alone = native_kernels.fp32_linear(x[row : row + 1], weight, bias)
        assert torch.equal(alone[0], together[row])
    # Rows of a wider tensor (a strided view) are read in place.
    wide = torch.randn(4, 310)[:, :300]
    assert torch.equal(
        native_kernels.fp32_linear(wide, weight), native_kernels.fp32_linear(wide.contiguous(), weight)
    )


def test_the_layers_take_the_kernel_for_decode_rows_only(native_kernels: CpuKernels) -> None:
    torch.manual_seed(4)
    weight, bias = torch.randn(48, 64), torch.randn(48)
    few, many = torch.randn(FP32_NATIVE_MAX_ROWS, 64), torch.randn(FP32_NATIVE_MAX_ROWS + 1, 64)
    assert torch.equal(
        fp32_matmul(native_kernels, few, weight, bias), native_kernels.fp32_linear(few, weight, bias)
    )
    assert torch.equal(fp32_matmul(native_kernels, many, weight, bias), F.linear(many, weight, bias))
    assert torch.equal(fp32_matmul(None, few, weight, bias), F.linear(few, weight, bias))
    with pytest.raises(ValueError, match="expected fp32"):
        native_kernels.fp32_linear(few.bfloat16(), weight)
