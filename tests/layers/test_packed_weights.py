"""Packed bf16 linear weights (layers/packed_weights.py): oneDNN's row padding must not change a
single result, and the native AMX matmul must agree with an fp32 reference."""

from __future__ import annotations

import pytest
import torch

from radixserve.kernels.cpu_ops import CpuKernels
from radixserve.layers.packed_weights import (
    WeightPacking,
    cpu_packing_supported,
    onednn_linear,
    round_up_to_eighth,
)
from tests.conftest import exact_linear

needs_onednn = pytest.mark.skipif(
    not cpu_packing_supported(torch.bfloat16, torch.device("cpu")), reason="needs oneDNN on this CPU"
)


def test_row_buckets_are_few_and_tight() -> None:
    assert [round_up_to_eighth(n) for n in range(1, 17)] == list(range(1, 17))
    sizes = {round_up_to_eighth(n) for n in range(1, 8193)}
    assert len(sizes) <= 16 + 8 * 9  # exact up to 16, then eight sizes per power of two
    for n in range(1, 8193):
        assert n <= round_up_to_eighth(n) <= n * 1.125
    assert (
        round_up_to_eighth(2048) == 2048 and round_up_to_eighth(992) == 1024 and round_up_to_eighth(33) == 36
    )


@needs_onednn
@pytest.mark.parametrize("rows", [3, 17, 100, 1000])
def test_padded_rows_give_the_same_bits(rows: int) -> None:
    torch.manual_seed(rows)
    weight = torch.randn(96, 64, dtype=torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    bias = torch.randn(96, dtype=torch.bfloat16)
    x = torch.randn(rows, 64, dtype=torch.bfloat16)
    residual = torch.randn(rows, 96, dtype=torch.bfloat16)
    plain = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    assert torch.equal(onednn_linear(x, packed, bias), plain)
    fused = torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, None, "add")
    assert torch.equal(onednn_linear(x, packed, None, residual), fused)
    torch.testing.assert_close(
        plain.float(), (x.float() @ weight.float().T + bias.float()), atol=0.1, rtol=0.02
    )


# Row counts around the kernel's 16-row tiles and 32-row blocks; shapes with one column block (the
# threads then split the rows) and with long inputs.
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 31, 32, 33, 70, 300])
@pytest.mark.parametrize(("out_features", "in_features"), [(32, 64), (96, 64), (64, 1536), (576, 576)])
def test_amx_matmul_matches_fp32(
    amx_kernels: CpuKernels, rows: int, out_features: int, in_features: int
) -> None:
    torch.manual_seed(rows * out_features + in_features)
    weight = torch.randn(out_features, in_features, dtype=torch.bfloat16) / in_features**0.5
    bias = torch.randn(out_features, dtype=torch.bfloat16)
    residual = torch.randn(rows, out_features, dtype=torch.bfloat16)
    x = torch.randn(rows, in_features + 8, dtype=torch.bfloat16)[:, :in_features]  # rows apart by more
    packed = WeightPacking(amx_kernels).pack(weight)
    assert packed.kernels is amx_kernels, "the AMX layout was not used"
    assert torch.equal(packed.to_dense(), weight)
    for b, r in ((None, None), (bias, None), (None, residual), (bias, residual)):
        got = packed.matmul(x, b, r)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
        expected = exact_linear(x, weight, b, r).float()
        # fp32 sums in another order, then one rounding: within one bf16 step of the exact result.
        torch.testing.assert_close(got.float(), expected, rtol=2**-7, atol=1e-5)


def test_amx_matmul_takes_no_rows(amx_kernels: CpuKernels) -> None:
    packed = WeightPacking(amx_kernels).pack(torch.randn(64, 64, dtype=torch.bfloat16))
    assert packed.matmul(torch.empty(0, 64, dtype=torch.bfloat16)).shape == (0, 64)


@needs_onednn
def test_shapes_the_amx_matmul_cannot_run_go_to_onednn(amx_kernels: CpuKernels) -> None:
    weight = torch.randn(40, 64, dtype=torch.bfloat16)  # 40 output columns: not whole 32-column blocks
    packed = WeightPacking(amx_kernels).pack(weight)
    assert packed.kernels is None
    assert torch.equal(packed.to_dense(), weight)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(packed.matmul(x).float(), x.float() @ weight.float().T, rtol=2**-7, atol=1e-5)
    assert amx_kernels.pack_linear(weight.float()) is None  # and fp32 is never packed for it
