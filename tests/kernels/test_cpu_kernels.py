"""The native CPU kernels against the torch code they replace (radixserve/kernels)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from radixserve.attention.base import AttentionSpec, LayerInputs
from radixserve.attention.common import decode_shared_prefix, merge_by_lse
from radixserve.attention.cpu_native import CpuNativeBackend
from radixserve.forward.batch import build_decode_layout
from radixserve.kernels.cpu_ops import CpuKernels, SharedPrefixResult, select_cpu_kernels
from radixserve.layers.activation import gelu_tanh_and_mul, silu_and_mul
from radixserve.layers.norm import RMSNorm
from radixserve.layers.rotary import Rope, RotaryEmbedding
from radixserve.models.gemma3 import GemmaRMSNorm
from tests.kernels.select_in_subprocess import select_with

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def kernels(native_kernels: CpuKernels) -> CpuKernels:
    return native_kernels


def mismatch_fraction(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a != b).float().mean())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [576, 64, 37, 5, 8192 + 11])
def test_rms_norm_is_bit_identical_to_torch(kernels: CpuKernels, dtype: torch.dtype, size: int) -> None:
    """The kernel adds its sum of squares in torch's order, so it is the reference bit for bit. In
    any other order the fp32 mean is an ulp off now and then: every fp32 output shows it, and a bf16
    output where it sits at a rounding midpoint, about one row in two thousand here (enough to move
    SmolLM2's bf16 logits from 0.108 to 0.145 mean |error|: tests/engine/test_smollm2_gguf.py).
    Sizes: the cascade of torch's sum (576 and more), its scalar leftovers (37), a row too short for
    one vector (5), and a hidden size whose sum takes several cascade levels."""
    torch.manual_seed(0)
    rows = 4000 if size == 576 else 20 if size > 8192 else 300
    # Rows apart by more than their size, and of different magnitudes.
    x = (torch.randn(rows, size + 5) * torch.rand(rows, 1) * 4).to(dtype)[:, :size]
    norm = RMSNorm(size, 1e-5)
    norm.weight.data = torch.randn(size, dtype=dtype)
    expected = norm(x)
    native = kernels.rms_norm(x, norm.weight, 1e-5)
    assert native is not None and native.dtype == dtype
    assert torch.equal(native, expected), f"{int((native != expected).sum())} elements differ"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [640, 256, 37])
def test_gemma_rms_norm_is_bit_identical_to_torch(kernels: CpuKernels, dtype: torch.dtype, size: int) -> None:
    """unit_offset: Gemma's norm, scaled by 1 + weight in fp32 and rounded once (GemmaRMSNorm's torch
    ops), over hidden rows (640) and q/k heads (256)."""
    torch.manual_seed(0)
    x = (torch.randn(300, size + 3) * torch.rand(300, 1) * 4).to(dtype)[:, :size]
    norm = GemmaRMSNorm(size, 1e-6)
    norm.weight.data = torch.randn(size, dtype=dtype)
    expected = norm(x)  # no kernels: torch ops
    native = kernels.rms_norm(x, norm.weight, 1e-6, unit_offset=True)
    assert native is not None and native.dtype == dtype
    assert torch.equal(native, expected), f"{int((native != expected).sum())} elements differ"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [1536, 40])
def test_gelu_tanh_and_mul_matches_torch(kernels: CpuKernels, dtype: torch.dtype, size: int) -> None:
    """GELU's tanh approximation as g / (1 + exp(-2u)): the function within fp32 rounding of its
    float64 value. (torch's 1 + tanh(u) cancels for negative gates: it is the one further off there,
    by up to 2e-3 relative, and float64's own 1 + tanh(u) is 0 below u = -19.) In bf16, that value
    rounded as torch rounds (the activation, then its product with up), but for rare ties and the
    far negative tail."""
    torch.manual_seed(1)
    x = torch.randn(64, 2 * size, dtype=dtype) * 4
    x[0, :6] = torch.tensor([-100.0, 100.0, 0.0, -0.0, 1e-20, -1e-20])  # exp's overflow and underflow
    native = gelu_tanh_and_mul(x, kernels)
    if dtype == torch.float32:
        exact = gelu_tanh_and_mul(x.double()).float()
        torch.testing.assert_close(native, exact, rtol=4e-6, atol=1e-6)
    else:
        gate, up = x.chunk(2, dim=-1)
        activated = F.gelu(gate.double(), approximate="tanh").to(dtype)
        expected = (activated.float() * up.float()).to(dtype)
        torch.testing.assert_close(native, expected, rtol=8e-3, atol=1e-10)
        visible = expected.abs() > 1e-10
        assert mismatch_fraction(native[visible], expected[visible]) < 1e-3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [1536, 40])
def test_silu_and_mul_matches_torch(kernels: CpuKernels, dtype: torch.dtype, size: int) -> None:
    torch.manual_seed(1)
    x = torch.randn(64, 2 * size, dtype=dtype) * 4
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's overflow and underflow
    expected = silu_and_mul(x)
    native = silu_and_mul(x, kernels)
    # exp may differ from torch's in the last fp32 bit.
    torch.testing.assert_close(native, expected, rtol=1e-6 if dtype == torch.float32 else 8e-3, atol=1e-30)
    if dtype == torch.bfloat16:
        assert mismatch_fraction(native, expected) < 1e-3


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_takes_a_prefill(kernels: CpuKernels, dtype: torch.dtype) -> None:
    """A chunked prefill's gate/up (2048 tokens x SmolLM2's 1536): ~100k vector steps per thread.
    An AVX2 build once lost 192 bytes of stack per step there (vec16.h, fma16) and crashed."""
    x = torch.randn(2048, 2 * 1536, dtype=dtype)
    torch.testing.assert_close(
        silu_and_mul(x, kernels), silu_and_mul(x), rtol=1e-6 if dtype == torch.float32 else 8e-3, atol=1e-30
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(64, 64), (128, 128), (40, 40), (128, 96), (64, 16)])
def test_rotary_is_bit_identical_to_torch(
    kernels: CpuKernels, dtype: torch.dtype, head_dim: int, rotary_dim: int
) -> None:
    """Whole heads, and a partial rotary factor (Phi-4-mini's 96 of 128): the rest untouched."""
    torch.manual_seed(2)
    rotary = RotaryEmbedding(rotary_dim, 4096, 10000.0, None)
    positions = torch.randint(0, 4096, (50,))
    qkv = torch.randn(50, 7 * head_dim + 3, dtype=dtype)  # rows wider than the rotated heads
    heads = qkv[:, : 6 * head_dim].view(50, 6, head_dim)
    expected = rotary.lookup(positions, dtype).rotate_(heads.clone())
    rope = rotary.lookup(positions, dtype, kernels)
    assert rope.rotate_(heads) is heads  # rotated in place
    assert torch.equal(heads, expected)


def test_ops_decline_what_they_cannot_address(kernels: CpuKernels) -> None:
    x = torch.randn(4, 8, dtype=torch.float16)
    assert kernels.rms_norm(x, torch.ones(8, dtype=torch.float16), 1e-5) is None
    assert kernels.silu_and_mul(torch.randn(4, 8).t()) is None  # not row-major
    assert kernels.rms_norm(torch.randn(2, 3, 8), torch.ones(8), 1e-5) is None  # not 2-D
    rope = Rope(torch.zeros(4, dtype=torch.int64), torch.ones(64, 4), torch.zeros(64, 4), torch.float32)
    assert not kernels.rotary_(
        torch.randn(4, 8, 2).transpose(1, 2), rope.cos_table, rope.sin_table, rope.positions
    )
    assert not kernels.handles_decode_attention(9, 3, 80, torch.float32)  # no kernel for head_dim 80
    assert not kernels.handles_decode_attention(9, 3, 64, torch.float16)
    assert kernels.handles_decode_attention(9, 3, 64, torch.bfloat16)


def reference_decode(q, k_cache, v_cache, table, rows, lens, scale, window=None):  # type: ignore[no-untyped-def]
    """With a window w, each request attends its last w positions."""
    out = torch.empty_like(q)
    heads, kv_heads = q.shape[1], k_cache.shape[1]
    for b in range(q.shape[0]):
        first = 0 if window is None else max(0, int(lens[b]) - window)
        slots = table[rows[b], first : lens[b]]
        k = k_cache[slots].transpose(0, 1).float()
        v = v_cache[slots].transpose(0, 1).float()
        qq = q[b].float().view(kv_heads, heads // kv_heads, -1)
        out[b] = F.scaled_dot_product_attention(qq, k, v, scale=scale).reshape(heads, -1).to(q.dtype)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "lengths"),
    [
        (9, 3, 64, [300, 17, 1, 64, 65, 250]),  # SmolLM2's heads, mixed lengths
        (4, 4, 128, [1000]),  # one long request: split into pieces across threads
        (8, 1, 64, [33] * 40),  # many equal requests, one K/V head
        (4, 2, 16, [5, 40, 129]),  # the tiny test models' heads
        (6, 2, 32, [70, 3]),
        (4, 1, 256, [600, 9]),  # Gemma 3 270M / 1B
        (8, 4, 256, [130]),  # Gemma 3 4B to 27B
    ],
)
def test_decode_attention_matches_sdpa(
    kernels: CpuKernels, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, lengths: list[int]
) -> None:
    torch.manual_seed(3)
    slots_total = 4000
    k_cache = torch.randn(slots_total, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.randn(slots_total, kv_heads, head_dim, dtype=dtype)
    table = torch.zeros(64, 1200, dtype=torch.int64)
    rows = torch.randperm(64)[: len(lengths)]
    for row, length in zip(rows.tolist(), lengths, strict=True):
        table[row, :length] = torch.randperm(slots_total)[:length]  # scattered, as in a paged pool
    lens = torch.tensor(lengths)
    # q as a view of a wider projection output, like the model's.
    q = torch.randn(len(lengths), heads * head_dim + 32, dtype=dtype)[:, : heads * head_dim]
    q = q.view(len(lengths), heads, head_dim)
    scale = head_dim**-0.5
    native = kernels.decode_attention(q, k_cache, v_cache, table, rows, lens, scale)
    expected = reference_decode(q, k_cache, v_cache, table, rows, lens, scale)
    assert native is not None
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(native, expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fixed_pieces", [0, 16])
def test_decode_attention_within_a_sliding_window(
    kernels: CpuKernels, dtype: torch.dtype, fixed_pieces: int
) -> None:
    """A sliding layer's decode: each request reads its last `window` positions only (contexts
    shorter than, as long as and longer than the window), also in the batch-invariant pieces; the
    kernel refuses a window together with a shared prefix."""
    torch.manual_seed(5)
    heads, kv_heads, head_dim, window = 4, 2, 64, 48
    lengths = [5, 47, 48, 49, 300, 1000]
    k_cache = torch.randn(3000, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.randn(3000, kv_heads, head_dim, dtype=dtype)
    table = torch.zeros(len(lengths), 1000, dtype=torch.int64)
    for row, length in enumerate(lengths):
        table[row, :length] = torch.randperm(3000)[:length]
    rows, lens = torch.arange(len(lengths)), torch.tensor(lengths)
    q = torch.randn(len(lengths), heads, head_dim, dtype=dtype)
    scale = head_dim**-0.5
    kernels.set_decode_fixed_pieces(fixed_pieces)
    try:
        native = kernels.decode_attention(q, k_cache, v_cache, table, rows, lens, scale, window=window)
    finally:
        kernels.set_decode_fixed_pieces(0)
    assert native is not None
    expected = reference_decode(q, k_cache, v_cache, table, rows, lens, scale, window)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(native, expected, rtol=tolerance, atol=tolerance)
    prefix = SharedPrefixResult(
        4, torch.zeros(kv_heads, len(lengths) * 2, head_dim, dtype=dtype), torch.zeros(1)
    )
    assert kernels.decode_attention(q, k_cache, v_cache, table, rows, lens, scale, prefix, window) is None


def test_select_torch_loads_nothing() -> None:
    assert select_cpu_kernels("torch", torch.device("cpu")) is None


def test_missing_compiler_is_reported(tmp_path: os.PathLike[str]) -> None:
    """auto falls back to torch with a warning; native fails with the reason."""
    done = select_with({"CXX": "/nonexistent/g++", "RADIXSERVE_KERNEL_CACHE": str(tmp_path)})
    assert "REASON /nonexistent/g++ failed" in done.stdout


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_over_a_shared_prefix(kernels: CpuKernels, dtype: torch.dtype) -> None:
    """Requests sharing their first 100 KV slots: the prefix is attended once for all of them
    (cascade) and merged with each request's own part by log-sum-exp."""
    torch.manual_seed(4)
    heads, kv_heads, head_dim, shared = 9, 3, 64, 100
    k_cache = torch.randn(3000, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.randn(3000, kv_heads, head_dim, dtype=dtype)
    lengths = [101, 140, 333, 102]
    table = torch.zeros(8, 400, dtype=torch.int64)
    prefix = torch.randperm(3000)[:shared]
    rows = torch.tensor([5, 0, 3, 6])
    for row, length in zip(rows.tolist(), lengths, strict=True):
        table[row, :shared] = prefix
        table[row, shared:length] = 2000 + torch.randperm(1000)[: length - shared]
    lens = torch.tensor(lengths)
    layout = build_decode_layout(table, rows, lens)
    shared_slots = decode_shared_prefix(layout)
    assert shared_slots is not None and len(shared_slots) == shared
    q = torch.randn(len(lengths), heads, head_dim, dtype=dtype)
    cpu = torch.device("cpu")
    backend = CpuNativeBackend(AttentionSpec(1, heads, kv_heads, head_dim, dtype, cpu, kernels, 0))
    metadata = backend.plan_decode(layout)
    native = backend.decode(LayerInputs(0, q, q, q, k_cache, v_cache, head_dim**-0.5), metadata)
    expected = reference_decode(q, k_cache, v_cache, table, rows, lens, head_dim**-0.5)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(native, expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_by_lse_matches_torch(kernels: CpuKernels, dtype: torch.dtype) -> None:
    torch.manual_seed(5)
    # Part a as attention returns it per K/V head ([Hkv, N * G, D] viewed as [N, Hkv, G, D]).
    a = torch.randn(3, 50 * 3, 64, dtype=dtype).view(3, 50, 3, 64).permute(1, 0, 2, 3)
    lse_a = (torch.randn(3, 50 * 3) * 3).view(3, 50, 3).permute(1, 0, 2)
    b = torch.randn(50, 3, 3, 64, dtype=dtype)
    lse_b = torch.randn(50, 3, 3) * 3
    native = kernels.merge_by_lse(a, lse_a, b, lse_b)
    expected = merge_by_lse(a.reshape(50, 9, 64), lse_a.reshape(50, 9), b.view(50, 9, 64), lse_b.view(50, 9))
    assert native is not None
    tolerance = 1e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(native, expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize(
    ("count", "heads", "kv_heads", "head_dim", "length"),
    [
        (32, 9, 3, 64, 512),  # SmolLM2's W2 decode step
        (5, 4, 1, 32, 37),  # a partial 32-key step and a partial 16-row block
        (7, 8, 8, 128, 100),  # head_dim 128: two 64-wide passes over the values
        (300, 6, 2, 64, 33),  # many rows (an extend's shared part)
    ],
)
@pytest.mark.parametrize("kernel", ["vector", "amx"])
def test_prefix_attention_matches_sdpa(
    kernels: CpuKernels, kernel: str, count: int, heads: int, kv_heads: int, head_dim: int, length: int
) -> None:
    if kernel == "amx" and not kernels.has_amx_linear:
        pytest.skip("this CPU (or OS) does not offer AMX tiles")
    torch.manual_seed(count + length)
    group = heads // kv_heads
    # Queries as rows of a wider projection, keys and values as a cache's rows.
    q = torch.randn(count, heads * head_dim + 40, dtype=torch.bfloat16)[:, : heads * head_dim]
    q = q.view(count, heads, head_dim)
    keys = torch.randn(length, kv_heads, head_dim, dtype=torch.bfloat16)
    values = torch.randn(length, kv_heads, head_dim, dtype=torch.bfloat16)
    scale = head_dim**-0.5
    result = kernels.prefix_attention(q, keys, values, scale, kernel)
    assert result is not None and result.length == length
    rows = count * group
    assert result.out.shape == (kv_heads, rows, head_dim) and result.lse.shape == (kv_heads, rows)
    # Reference in fp32: row n * G + g of K/V head h is query h * G + g of token n.
    stacked = q.float().view(count, kv_heads, group, head_dim).permute(1, 0, 2, 3).reshape(kv_heads, rows, -1)
    k32, v32 = keys.float().transpose(0, 1), values.float().transpose(0, 1)
    scores = stacked @ k32.transpose(1, 2) * scale
    expected = F.softmax(scores, dim=-1) @ v32
    torch.testing.assert_close(result.out.float(), expected, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(result.lse, torch.logsumexp(scores, dim=-1), rtol=1e-4, atol=1e-4)


def test_prefix_attention_declines_what_it_cannot_run(kernels: CpuKernels) -> None:
    q = torch.randn(4, 4, 64, dtype=torch.bfloat16)
    keys = torch.randn(40, 2, 64, dtype=torch.bfloat16)
    assert kernels.prefix_attention(q.float(), keys.float(), keys.float(), 0.1) is None  # fp32
    small = torch.randn(4, 4, 16, dtype=torch.bfloat16)
    assert kernels.prefix_attention(small, small[:, :2], small[:, :2], 0.1, "amx") is None  # head_dim 16
    assert kernels.prefix_attention(small, small[:, :2], small[:, :2], 0.1, "vector") is not None
    narrow = torch.randn(4, 4, 24, dtype=torch.bfloat16)
    assert kernels.prefix_attention(narrow, narrow[:, :2], narrow[:, :2], 0.1) is None  # head_dim 24
    odd = torch.randn(40, 3, 64, dtype=torch.bfloat16)
    assert kernels.prefix_attention(q, odd, odd, 0.1) is None  # 4 heads over 3 K/V heads
    assert kernels.prefix_attention(q, keys.transpose(0, 1), keys.transpose(0, 1), 0.1) is None  # layout


@pytest.mark.parametrize(("rows", "cols"), [(32, 49152), (1, 49152), (3, 37), (5, 16), (4, 100)])
def test_argmax_rows_matches_torch_max(kernels: CpuKernels, rows: int, cols: int) -> None:
    """The greedy choice: the first index of each row's maximum, a NaN counting as the maximum."""
    torch.manual_seed(rows + cols)
    x = torch.randn(rows, cols + 3)[:, :cols]  # rows apart by more than their length
    x[0, 5] = x[0].max() + 1
    x[0, cols - 1] = x[0, 5]  # a tie: the first one wins
    cases = [x, torch.full((rows, cols), float("-inf"))]
    with_nan = x.clone()
    with_nan[-1, cols // 2] = float("nan")
    with_nan[-1, cols - 1] = float("nan")
    cases.append(with_nan)
    for case in cases:
        native = kernels.argmax_rows(case)
        assert native is not None and torch.equal(native, case.max(dim=-1).indices)
    assert kernels.argmax_rows(x.to(torch.bfloat16)) is None  # fp32 only


@pytest.mark.parametrize(
    ("count", "heads", "kv_heads", "head_dim", "prefix"),
    [
        (256, 9, 3, 64, 0),  # a W1 prompt: causal over its own tokens only
        (7, 4, 1, 32, 37),  # on a cached prefix, a partial 32-key step
        (40, 8, 8, 128, 100),  # head_dim 128
        (1, 6, 2, 64, 5),  # one new token
    ],
)
@pytest.mark.parametrize("kernel", ["vector", "amx"])
def test_causal_attention_matches_sdpa(
    kernels: CpuKernels, kernel: str, count: int, heads: int, kv_heads: int, head_dim: int, prefix: int
) -> None:
    if kernel == "amx" and not kernels.has_amx_linear:
        pytest.skip("this CPU (or OS) does not offer AMX tiles")
    torch.manual_seed(count + prefix)
    k_cache = torch.randn(600, kv_heads, head_dim, dtype=torch.bfloat16)
    v_cache = torch.randn(600, kv_heads, head_dim, dtype=torch.bfloat16)
    slots = torch.randperm(600)[: prefix + count]
    q = torch.randn(count, heads * head_dim + 24, dtype=torch.bfloat16)[:, : heads * head_dim]
    q = q.view(count, heads, head_dim)
    scale = head_dim**-0.5
    native = kernels.causal_attention(q, k_cache, v_cache, slots, prefix, scale, kernel)
    assert native is not None and native.shape == (count, heads, head_dim)
    group = heads // kv_heads
    keys = k_cache[slots].float().repeat_interleave(group, dim=1).transpose(0, 1)
    values = v_cache[slots].float().repeat_interleave(group, dim=1).transpose(0, 1)
    visible = torch.arange(prefix + count).unsqueeze(0) <= (torch.arange(count) + prefix).unsqueeze(1)
    expected = F.scaled_dot_product_attention(
        q.float().transpose(0, 1), keys, values, attn_mask=visible, scale=scale
    )
    torch.testing.assert_close(native.float(), expected.transpose(0, 1), rtol=2e-2, atol=2e-2)
    assert (
        kernels.causal_attention(q, k_cache, v_cache, slots[:-1], prefix, scale, kernel) is None
    )  # wrong length
