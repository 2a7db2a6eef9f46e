"""Packed bf16 linears pad their rows to a few sizes (one oneDNN kernel build per size); the
padding must not change a single result."""

from __future__ import annotations

import pytest
import torch

from radixserve.model.layers import cpu_packing_supported, packed_linear, round_up_to_eighth


def test_row_buckets_are_few_and_tight() -> None:
    assert [round_up_to_eighth(n) for n in range(1, 17)] == list(range(1, 17))
    sizes = {round_up_to_eighth(n) for n in range(1, 8193)}
    assert len(sizes) <= 16 + 8 * 9  # exact up to 16, then eight sizes per power of two
    for n in range(1, 8193):
        assert n <= round_up_to_eighth(n) <= n * 1.125
    assert (
        round_up_to_eighth(2048) == 2048 and round_up_to_eighth(992) == 1024 and round_up_to_eighth(33) == 36
    )


@pytest.mark.skipif(
    not cpu_packing_supported(torch.bfloat16, torch.device("cpu")), reason="needs oneDNN on this CPU"
)
@pytest.mark.parametrize("rows", [3, 17, 100, 1000])
def test_padded_rows_give_the_same_bits(rows: int) -> None:
    torch.manual_seed(rows)
    weight = torch.randn(96, 64, dtype=torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    bias = torch.randn(96, dtype=torch.bfloat16)
    x = torch.randn(rows, 64, dtype=torch.bfloat16)
    residual = torch.randn(rows, 96, dtype=torch.bfloat16)
    plain = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    assert torch.equal(packed_linear(x, packed, bias), plain)
    fused = torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, None, "add")
    assert torch.equal(packed_linear(x, packed, None, residual), fused)
    torch.testing.assert_close(
        plain.float(), (x.float() @ weight.float().T + bias.float()), atol=0.1, rtol=0.02
    )
