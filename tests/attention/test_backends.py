"""The attention backends' paths against a dense reference, with mixed lengths, prefixes and GQA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixserve.attention.base import AttentionBackendUnavailable, AttentionSpec, LayerInputs
from radixserve.attention.common import shared_prefix_groups
from radixserve.attention.cpu_native import CpuNativeBackend
from radixserve.attention.extend import CpuAttentionOps, extend_attention
from radixserve.attention.registry import choose_attention_backend
from radixserve.attention.torch_native import TorchNativeBackend
from radixserve.forward.batch import DecodeLayout, ExtendSegment, build_decode_layout
from radixserve.kernels.cpu_ops import CpuKernels
from tests.conftest import native_kernels_or_skip

HEADS, KV_HEADS, DIM = 6, 2, 16


def _spec(kernels: CpuKernels | None = None, heads: int = HEADS, kv_heads: int = KV_HEADS, dim: int = DIM,
          dtype: torch.dtype = torch.float32, staging: int = 0) -> AttentionSpec:  # fmt: skip
    return AttentionSpec(1, heads, kv_heads, dim, dtype, torch.device("cpu"), kernels, staging)


def _decode(backend_name: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            layout: DecodeLayout, cascade: bool = True) -> torch.Tensor:  # fmt: skip
    """One decode layer through the named backend (the new tokens' K/V are already in the pool)."""
    if backend_name == "torch_native":
        torch_backend = TorchNativeBackend(_spec())
        torch_backend.cascade = cascade
        metadata = torch_backend.plan_decode(layout)
        new = q[:, :KV_HEADS]
        return torch_backend.decode(LayerInputs(0, q, new, new, k_cache, v_cache, DIM**-0.5), metadata)
    native = CpuNativeBackend(_spec(native_kernels_or_skip()))
    native_metadata = native.plan_decode(layout)
    new = q[:, :KV_HEADS]
    return native.decode(LayerInputs(0, q, new, new, k_cache, v_cache, DIM**-0.5), native_metadata)


BACKENDS = ["torch_native", "cpu_native"]


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """Dense causal attention of q ([L, H, D], positions prefix_len..) over k, v ([S, Hkv, D])."""
    group = HEADS // KV_HEADS
    kk = k.repeat_interleave(group, dim=1).transpose(0, 1)
    vv = v.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q.transpose(0, 1) @ kk.transpose(1, 2) / DIM**0.5
    q_pos = torch.arange(q.shape[0]).unsqueeze(1) + prefix_len
    scores = scores.masked_fill(torch.arange(k.shape[0]).unsqueeze(0) > q_pos, float("-inf"))
    return (F.softmax(scores, dim=-1) @ vv).transpose(0, 1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_attention_matches_dense_for_mixed_lengths(backend: str) -> None:
    torch.manual_seed(0)
    lengths = [1, 7, 30, 3]
    slots_total = 64
    k_cache, v_cache = torch.randn(slots_total, KV_HEADS, DIM), torch.randn(slots_total, KV_HEADS, DIM)
    table = torch.zeros(len(lengths), 40, dtype=torch.int64)
    perm = torch.randperm(slots_total)
    offset = 0
    for i, n in enumerate(lengths):
        table[i, :n] = perm[offset : offset + n]
        offset += n
    layout = build_decode_layout(table, torch.arange(len(lengths)), torch.tensor(lengths))
    q = torch.randn(len(lengths), HEADS, DIM)
    out = _decode(backend, q, k_cache, v_cache, layout)
    for i, n in enumerate(lengths):
        slots = table[i, :n]
        expected = _reference(q[i : i + 1], k_cache[slots], v_cache[slots], prefix_len=n - 1)
        torch.testing.assert_close(out[i : i + 1], expected, atol=1e-5, rtol=1e-5)


def test_extend_attention_with_and_without_prefix() -> None:
    torch.manual_seed(1)
    k_cache, v_cache = torch.randn(50, KV_HEADS, DIM), torch.randn(50, KV_HEADS, DIM)
    prefix_slots = torch.tensor([3, 9, 4, 20, 11])
    q = torch.randn(7, HEADS, DIM)
    k, v = torch.randn(7, KV_HEADS, DIM), torch.randn(7, KV_HEADS, DIM)
    segments = [
        ExtendSegment(q_start=0, q_len=4, prefix_len=0, prefix_slots=torch.empty(0, dtype=torch.int64)),
        ExtendSegment(q_start=4, q_len=3, prefix_len=5, prefix_slots=prefix_slots),
    ]
    out = extend_attention(q, k, v, k_cache, v_cache, segments, DIM**-0.5)
    torch.testing.assert_close(out[:4], _reference(q[:4], k[:4], v[:4], 0), atol=1e-5, rtol=1e-5)
    keys = torch.cat((k_cache[prefix_slots], k[4:]))
    values = torch.cat((v_cache[prefix_slots], v[4:]))
    torch.testing.assert_close(out[4:], _reference(q[4:], keys, values, 5), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_attention_over_a_shared_prefix_matches_dense(backend: str) -> None:
    """Requests whose contexts start with the same KV slots take the cascade path."""
    torch.manual_seed(2)
    shared = torch.randperm(200)[:40]  # a 40-slot prefix all rows share (>= MIN_SHARED_PREFIX)
    own_lengths = [3, 9, 5, 12]  # one bucket: the longest is 52, the shortest 43 (>= 75%)
    k_cache, v_cache = torch.randn(300, KV_HEADS, DIM), torch.randn(300, KV_HEADS, DIM)
    table = torch.zeros(len(own_lengths), 80, dtype=torch.int64)
    fresh = iter(range(200, 300))
    for i, n in enumerate(own_lengths):
        table[i, :40] = shared
        table[i, 40 : 40 + n] = torch.tensor([next(fresh) for _ in range(n)])
    lengths = torch.tensor([40 + n for n in own_lengths])
    q = torch.randn(len(own_lengths), HEADS, DIM)
    layout = build_decode_layout(table, torch.arange(len(own_lengths)), lengths)
    for share in (True, False) if backend == "torch_native" else (True,):
        if backend == "torch_native":
            planned = TorchNativeBackend(_spec())
            planned.cascade = share
            assert (planned.plan_decode(layout).buckets[0].shared_slots is not None) == share
        out = _decode(backend, q, k_cache, v_cache, layout, cascade=share)
        for i, n in enumerate(lengths.tolist()):
            slots = table[i, :n]
            expected = _reference(q[i : i + 1], k_cache[slots], v_cache[slots], prefix_len=n - 1)
            torch.testing.assert_close(out[i : i + 1], expected, atol=1e-5, rtol=1e-5)


def test_extend_attention_over_a_shared_prefix_matches_dense() -> None:
    """Segments whose cached prefixes are the same slots take the cascade path."""
    torch.manual_seed(3)
    k_cache, v_cache = torch.randn(120, KV_HEADS, DIM), torch.randn(120, KV_HEADS, DIM)
    shared = torch.randperm(120)[:40]
    other = torch.randperm(120)[:35]
    lengths = [5, 5, 3, 4]  # three segments on the shared prefix (two as long), one on its own
    prefixes = [shared, shared, shared, other]
    total = sum(lengths)
    q = torch.randn(total, HEADS, DIM)
    k, v = torch.randn(total, KV_HEADS, DIM), torch.randn(total, KV_HEADS, DIM)
    segments, start = [], 0
    for n, prefix in zip(lengths, prefixes, strict=True):
        segments.append(ExtendSegment(q_start=start, q_len=n, prefix_len=len(prefix), prefix_slots=prefix))
        start += n
    assert shared_prefix_groups(segments) == [[0, 1, 2]]
    out = extend_attention(q, k, v, k_cache, v_cache, segments, DIM**-0.5)
    for seg in segments:
        rows = slice(seg.q_start, seg.q_start + seg.q_len)
        keys = torch.cat((k_cache[seg.prefix_slots], k[rows]))
        values = torch.cat((v_cache[seg.prefix_slots], v[rows]))
        expected = _reference(q[rows], keys, values, seg.prefix_len)
        torch.testing.assert_close(out[rows], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("prefix_kernel", ["vector", "amx"])
def test_extend_with_native_kernels_matches_torch(
    prefix_kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 with SmolLM2's head shape: the shared part of a cascade runs on the native prefix
    attention kernel (vector FMAs on any CPU, AMX tiles where this CPU has them; with AMX a single
    request's causal extend too), and the result must agree with the torch path."""
    kernels = native_kernels_or_skip()
    if prefix_kernel == "amx" and not kernels.has_amx_linear:
        pytest.skip("this CPU (or OS) does not offer AMX tiles")
    torch.manual_seed(6)
    heads, kv_heads, dim = 9, 3, 64
    k_cache = torch.randn(700, kv_heads, dim, dtype=torch.bfloat16)
    v_cache = torch.randn(700, kv_heads, dim, dtype=torch.bfloat16)
    slots = torch.randperm(700)
    shared = slots[:200]
    lengths = [7, 7, 7, 3]
    total = sum(lengths) + 40
    q = torch.randn(total, heads, dim, dtype=torch.bfloat16)
    k = torch.randn(total, kv_heads, dim, dtype=torch.bfloat16)
    v = torch.randn(total, kv_heads, dim, dtype=torch.bfloat16)
    segments, start = [], 0
    for n in lengths:
        segments.append(ExtendSegment(q_start=start, q_len=n, prefix_len=len(shared), prefix_slots=shared))
        start += n
    # One request alone: 40 new tokens after a 30-token cached prefix, its K/V in the pool.
    alone = slots[200:270]
    k_cache[alone[30:]], v_cache[alone[30:]] = k[start:], v[start:]
    segments.append(ExtendSegment(start, 40, 30, alone[:30], context_slots=alone))
    ran: list[str] = []
    for name in ("prefix_attention", "causal_attention"):
        original = getattr(CpuKernels, name)
        monkeypatch.setattr(
            CpuKernels, name, lambda self, *a, _f=original, _n=name: ran.append(_n) or _f(self, *a)
        )
    declined = kernels.fallbacks.copy()
    native = extend_attention(
        q, k, v, k_cache, v_cache, segments, dim**-0.5, CpuAttentionOps(kernels, prefix_kernel)
    )
    # A single request's extend runs natively on AMX only (extend.py says why).
    natives = ["causal_attention", "prefix_attention"] if prefix_kernel == "amx" else ["prefix_attention"]
    assert sorted(ran) == natives and kernels.fallbacks == declined
    plain = extend_attention(q, k, v, k_cache, v_cache, segments, dim**-0.5)
    torch.testing.assert_close(native.float(), plain.float(), rtol=2e-2, atol=2e-2)


def test_auto_takes_cpu_native_where_it_can_and_says_why_not() -> None:
    kernels = native_kernels_or_skip()
    assert choose_attention_backend("auto", _spec(kernels)).backend is CpuNativeBackend
    fallback = choose_attention_backend("auto", _spec(None))
    assert fallback.backend is TorchNativeBackend
    assert "native CPU kernels" in fallback.reason
    # A head shape without a compiled decode kernel.
    odd = choose_attention_backend("auto", _spec(kernels, heads=3, kv_heads=1, dim=80))
    assert odd.backend is TorchNativeBackend and "head_dim 80" in odd.reason
    assert choose_attention_backend("torch", _spec(kernels)).backend is TorchNativeBackend


def test_a_named_backend_that_cannot_run_says_why() -> None:
    with pytest.raises(AttentionBackendUnavailable, match="native CPU kernels"):
        choose_attention_backend("cpu_native", _spec(None))
    with pytest.raises(AttentionBackendUnavailable, match="unknown attention backend"):
        choose_attention_backend("flashinfer", _spec(None))
