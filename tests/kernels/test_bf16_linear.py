"""The non-AMX bf16 matmul (kernels/csrc/bf16_linear.cpp, CpuKernels.linear on its layout).

Its FMA builds (AVX2, AVX-512F) are checked bit for bit against torch summing in the order the
kernel documents (products of bf16 are exact in fp32, so each FMA is exactly torch's fp32 add of
that product); every build, the AVX-512 BF16 one included (vdpbf16ps flushes denormals), within
one bf16 rounding of the exact (fp64) result. scripts/test.sh reruns this for every forced ISA.
"""

from __future__ import annotations

import pytest
import torch

from radixserve.kernels.cpu_ops import CpuKernels
from tests.conftest import exact_linear


@pytest.fixture(scope="module")
def kernels(native_kernels: CpuKernels) -> CpuKernels:
    if native_kernels.linear_kernel is None or not native_kernels.linear_kernel.startswith("native_"):
        pytest.skip(f"the linear kernel here is {native_kernels.linear_kernel}, not bf16_linear.cpp's")
    return native_kernels


def _in_kernel_order(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None
) -> torch.Tensor:
    """The kernel's documented order, in torch: acc = 0; per input pair p, acc += x[2p+1] w[2p+1],
    then acc += x[2p] w[2p] (fp32 adds of exact products); (acc + bias) + residual; one rounding."""
    xf, wf = x.float(), weight.float()
    acc = torch.zeros(x.shape[0], weight.shape[0])
    for p in range(weight.shape[1] // 2):
        acc = acc + xf[:, 2 * p + 1 : 2 * p + 2] * wf[:, 2 * p + 1]
        acc = acc + xf[:, 2 * p : 2 * p + 1] * wf[:, 2 * p]
    if bias is not None:
        acc = acc + bias.float()
    if residual is not None:
        acc = acc + residual.float()
    return acc.bfloat16()


def _check(
    kernels: CpuKernels, got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, *extra: torch.Tensor | None
) -> None:
    bias, residual = extra
    assert got.dtype == torch.bfloat16 and got.shape == (x.shape[0], weight.shape[0])
    if kernels.linear_kernel != "native_avx512_bf16":
        expected = _in_kernel_order(x, weight, bias, residual)
        assert torch.equal(got, expected), float((got.float() - expected.float()).abs().max())
    # Any order of fp32 sums over K <= 4100 terms of size ~1, then one rounding to bf16: within a
    # bf16 step (2^-7 relative) of the exact sum, plus the fp32 sums' own error near zero.
    torch.testing.assert_close(got.double(), exact_linear(x, weight, bias, residual), rtol=2**-7, atol=1e-4)


# Row counts around the 4-row register tiles; column counts around the 16-column blocks and the
# 4-block tiles (2, 3 and 5 blocks: the blocks left after whole tiles run in one narrower tile; 960
# x 576: chunks of whole tiles, 2 blocks left per thread); K from one input pair up to down_proj's,
# and past 2,048 (a 4-block chunk outgrows L2's share: on AVX-512 it keeps its 4 blocks).
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 17, 33])
@pytest.mark.parametrize(
    ("out_features", "in_features"), [(16, 2), (48, 30), (80, 64), (960, 576), (32, 1538), (160, 4100)]
)
def test_matches_torch_in_its_summation_order(
    kernels: CpuKernels, rows: int, out_features: int, in_features: int
) -> None:
    torch.manual_seed(rows * 1000 + out_features + in_features)
    weight = torch.randn(out_features, in_features, dtype=torch.bfloat16) / in_features**0.5
    bias = torch.randn(out_features, dtype=torch.bfloat16)
    residual = torch.randn(rows, out_features, dtype=torch.bfloat16)
    x = torch.randn(rows, in_features + 6, dtype=torch.bfloat16)[:, :in_features]  # rows apart by more
    packed = kernels.pack_linear(weight)
    assert packed is not None and packed.dim() == 4, "bf16_linear's layout was not used"
    assert torch.equal(kernels.unpack_linear(packed), weight)
    for b, r in ((None, None), (bias, None), (None, residual), (bias, residual)):
        _check(kernels, kernels.linear(x, packed, b, r), x, weight, b, r)


def test_many_rows_and_threads(kernels: CpuKernels) -> None:
    """A prefill-sized call (split over the threads, blocks reused across row tiles) and a strided
    residual."""
    torch.manual_seed(3)
    weight = torch.randn(1536, 576, dtype=torch.bfloat16) / 24
    x = torch.randn(300, 576, dtype=torch.bfloat16)
    residual = torch.randn(300, 3000, dtype=torch.bfloat16)[:, 100:1636]
    packed = kernels.pack_linear(weight)
    assert packed is not None
    _check(kernels, kernels.linear(x, packed, None, residual), x, weight, None, residual)


def test_a_row_does_not_depend_on_the_others(kernels: CpuKernels) -> None:
    """Row i of an m-row call is bit for bit row i alone (the same sums in the same order whatever
    m, the row tile it falls in and how the threads split the work): batch invariance."""
    torch.manual_seed(5)
    weight = torch.randn(960, 576, dtype=torch.bfloat16) / 24
    bias = torch.randn(960, dtype=torch.bfloat16)
    packed = kernels.pack_linear(weight)
    assert packed is not None
    x = torch.randn(70, 576, dtype=torch.bfloat16)
    alone = torch.cat([kernels.linear(x[i : i + 1], packed, bias) for i in range(70)])
    for rows in (2, 3, 5, 32, 70):
        assert torch.equal(kernels.linear(x[:rows], packed, bias), alone[:rows]), rows


def test_takes_no_rows(kernels: CpuKernels) -> None:
    packed = kernels.pack_linear(torch.randn(32, 64, dtype=torch.bfloat16))
    assert packed is not None
    assert kernels.linear(torch.empty(0, 64, dtype=torch.bfloat16), packed).shape == (0, 32)


def test_declines_shapes_and_dtypes_it_cannot_run(kernels: CpuKernels) -> None:
    before = kernels.fallbacks["pack_linear"]
    assert kernels.pack_linear(torch.randn(40, 64, dtype=torch.bfloat16)) is None  # not 16-column blocks
    assert kernels.pack_linear(torch.randn(32, 63, dtype=torch.bfloat16)) is None  # not input pairs
    assert kernels.pack_linear(torch.randn(32, 64)) is None  # fp32
    assert kernels.fallbacks["pack_linear"] == before + 3
    packed = kernels.pack_linear(torch.randn(32, 64, dtype=torch.bfloat16))
    assert packed is not None
    with pytest.raises(ValueError, match="expected bf16 input"):
        kernels.linear(torch.randn(2, 62, dtype=torch.bfloat16), packed)
