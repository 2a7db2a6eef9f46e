"""The quantized-weight matmul (kernels/csrc/quant_linear.cpp, QuantKernels) against dequantize-then-
matmul, for every format, row counts 1-33 and odd shapes (column counts that leave a packed group
part empty). The reference dequantization is gguf's (as transformers') own, the activations rounded
to int16 blocks as the kernel's are. scripts/test.sh reruns this for every forced ISA (vpmaddwd on
256 and 512 bits, vpdpwssd)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve.kernels.cpu_ops import CpuKernels
from radixserve.kernels.native import load_library
from radixserve.kernels.quant_ops import QuantKernels
from radixserve.layers.quantized import KEPT_FORMATS, QuantizedTensor, QuantizedWeight
from tests.kernels.quant_blocks import quantize_like_kernel, random_quantized

FORMATS = list(KEPT_FORMATS)
# (rows of W, K): odd column counts (a 4-column tile and its tail), K of 1 to 9 blocks or super-blocks.
SHAPES = {32: [(37, 96), (5, 288)], 256: [(37, 512), (6, 256)]}


@pytest.fixture(scope="module")
def quant(native_kernels: CpuKernels) -> QuantKernels:
    if native_kernels.quant is None:
        pytest.skip(f"no quantized kernel in a build for {native_kernels.isa}")
    return QuantKernels(load_library())


def reference(x: torch.Tensor, weight: QuantizedTensor) -> torch.Tensor:
    return quantize_like_kernel(x) @ weight.dequantize().double().T


def layout_of(quant: QuantKernels, weight: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed weight and its one-part layout (the packed bytes must outlive the layout's use)."""
    packed = quant.pack(weight.format.type_id, weight.data, weight.cols)
    return packed, quant.parts_layout([(weight.format.type_id, weight.rows, packed)])


def tolerance(x: torch.Tensor, weight: QuantizedTensor) -> torch.Tensor:
    """fp32 sums of K products: a few fp32 steps of the sum of their magnitudes."""
    return 1e-5 * (x.double().abs() @ weight.dequantize().double().abs().T) + 1e-6


@pytest.mark.parametrize("name", FORMATS)
def test_every_row_count_matches_dequantize_then_matmul(quant: QuantKernels, name: str) -> None:
    block = KEPT_FORMATS[name].block
    for n, k in SHAPES[block]:
        weight = random_quantized(name, n, k, seed=n + k)
        _packed, layout = layout_of(quant, weight)  # the layout points into _packed
        generator = torch.Generator().manual_seed(k)
        x = torch.randn(33, k, generator=generator)
        whole = quant.linear(x, layout, n)
        for rows in range(1, 34):
            got = quant.linear(x[:rows], layout, n)
            # Row-invariant: each row's outputs are the same bits whatever the row count.
            assert torch.equal(got, whole[:rows]), (name, rows)
        error = (whole.double() - reference(x, weight)).abs()
        assert bool((error <= tolerance(x, weight)).all()), (name, n, k, float(error.max()))


@pytest.mark.parametrize("name", FORMATS)
def test_bf16_activations_bias_and_residual(quant: QuantKernels, name: str) -> None:
    block = KEPT_FORMATS[name].block
    n, k = SHAPES[block][0]
    weight = random_quantized(name, n, k, seed=3)
    _packed, layout = layout_of(quant, weight)  # the layout points into _packed
    x = torch.randn(9, k).bfloat16()
    bias, residual = torch.randn(n).bfloat16(), torch.randn(9, n).bfloat16()
    got = quant.linear(x, layout, n, bias, residual)
    assert got.dtype == torch.bfloat16
    exact = reference(x.float(), weight) + bias.double() + residual.double()
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
    singles = [layout_of(quant, p) for p in parts]
    expected = torch.cat(
        [quant.linear(x, layout, p.rows) for (_, layout), p in zip(singles, parts, strict=True)], 1
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
        _packed, layout = layout_of(quant, weight)  # the layout points into _packed
        got = quant.linear(x, layout, 24)
        error = (got.double() - reference(x, weight)).abs()
        assert bool((error <= tolerance(x, weight)).all()), name


@pytest.mark.parametrize("name", FORMATS)
def test_packed_weights_take_as_many_bytes_as_the_file(quant: QuantKernels, name: str) -> None:
    """Whole groups of 16 rows: the file's bytes (Q4_K and Q5_K keep their 6-bit scales as bytes)."""
    weight = random_quantized(name, 32, 512, seed=1)
    packed = quant.pack(weight.format.type_id, weight.data, weight.cols)
    extra = {"Q4_K": 4 * 32 * 2, "Q5_K": 4 * 32 * 2}.get(name, 0)  # 4 bytes a row per super-block
    assert packed.numel() == weight.nbytes + extra


def test_zero_activations_and_an_outlier_block(quant: QuantKernels) -> None:
    """A block of zeros (scale 0) and one large input beside small ones stay exact to the tolerance."""
    weight = random_quantized("Q4_K", 20, 256, seed=9)
    _, layout = layout_of(quant, weight)
    x = torch.randn(3, 256) * 1e-3
    x[0, :32] = 0.0
    x[1, 40] = 300.0
    got = quant.linear(x, layout, 20)
    error = (got.double() - reference(x, weight)).abs()
    assert bool((error <= tolerance(x, weight)).all()), float(error.max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_layer_in_one_call_equals_each_expert_alone(
    quant: QuantKernels, native_kernels: CpuKernels, dtype: torch.dtype
) -> None:
    """QuantKernels.moe (a Mixture-of-Experts layer's routed experts, models/moe.py): each row,
    bit for bit, its experts' gate_up matmul, silu_and_mul and down matmul run on it alone, times
    their weights, added in fp32 in ascending expert order; gate and up of different formats, an
    expert no row picks, experts listed in any order within a row."""
    hidden, inter = 256, 512
    formats = [
        ("Q4_K", "Q6_K", "Q8_0"),
        ("Q4_0", "Q4_0", "Q5_K"),
        ("Q8_0", "Q5_1", "Q4_1"),
        ("Q6_K", "Q4_K", "Q6_K"),
    ]
    experts = []
    for e, (gate, up, down) in enumerate(formats):
        gate_up = QuantizedWeight(
            [random_quantized(gate, inter, hidden, 10 * e), random_quantized(up, inter, hidden, 10 * e + 1)],
            quant,
        )
        experts.append((gate_up, QuantizedWeight([random_quantized(down, hidden, inter, 10 * e + 2)], quant)))
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(9, hidden, generator=generator).to(dtype)
    chosen = torch.tensor([[3, 0], [0, 2], [2, 3], [0, 3], [3, 2], [2, 0], [0, 2], [3, 0], [2, 3]])
    weights = torch.rand(9, 2, generator=generator)
    tables = (torch.stack([g.layout for g, _ in experts]), torch.stack([d.layout for _, d in experts]))
    got = quant.moe(tables, chosen, weights, x, inter)
    assert got.dtype == dtype
    for row in range(len(x)):
        total = torch.zeros(hidden)
        for e, weight in sorted(zip(chosen[row].tolist(), weights[row].tolist(), strict=True)):
            gate_up, down = experts[e]
            hidden_values = native_kernels.silu_and_mul(gate_up.matmul(x[row : row + 1]))
            assert hidden_values is not None
            total = total + down.matmul(hidden_values)[0].float() * torch.tensor(weight)
        assert torch.equal(got[row], total.to(dtype)), row


@pytest.mark.parametrize("normalize", [True, False])
def test_moe_route_is_softmax_then_top_k(quant: QuantKernels, normalize: bool) -> None:
    """QuantKernels.moe_route against torch's softmax, topk and renormalization: the same experts
    in the same order, and the same probabilities to a few fp32 steps."""
    logits = torch.randn(33, 60, generator=torch.Generator().manual_seed(1)) * 3
    chosen, weights = quant.moe_route(logits, 6, normalize)
    expected, expected_chosen = torch.softmax(logits, dim=-1).topk(6, dim=-1)
    if normalize:
        expected = expected / expected.sum(dim=-1, keepdim=True)
    assert torch.equal(chosen, expected_chosen)
    torch.testing.assert_close(weights, expected, rtol=1e-6, atol=1e-7)


def test_a_shared_expert_adds_its_gated_output_row_by_row(
    quant: QuantKernels, native_kernels: CpuKernels
) -> None:
    """QuantKernels.moe_shared_ (Qwen2-MoE's shared expert): each row gains sigmoid(gate . x) times
    down(silu(gate_up x)), the projections those its rows give alone, the gate within fp32 rounding
    of torch's."""
    hidden, inter = 256, 256
    gate_up = QuantizedWeight(
        [random_quantized("Q4_K", inter, hidden, 1), random_quantized("Q8_0", inter, hidden, 2)], quant
    )
    down = QuantizedWeight([random_quantized("Q6_K", hidden, inter, 3)], quant)
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(7, hidden, generator=generator)
    gate = torch.randn(1, hidden, generator=generator) * 0.1
    before = torch.randn(7, hidden, generator=generator)
    got = quant.moe_shared_((gate_up.layout, down.layout), gate, x, before.clone(), inter)
    for row in range(len(x)):
        activated = native_kernels.silu_and_mul(gate_up.matmul(x[row : row + 1]))
        assert activated is not None
        shared = down.matmul(activated)[0]
        scale = torch.sigmoid(x[row] @ gate[0])
        torch.testing.assert_close(got[row], before[row] + scale * shared, rtol=1e-5, atol=1e-5)
    # Row-invariant: a row alone gets the same bits.
    alone = quant.moe_shared_((gate_up.layout, down.layout), gate, x[3:4], before[3:4].clone(), inter)
    assert torch.equal(alone[0], got[3])
