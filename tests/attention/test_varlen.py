"""attention/varlen.py: the packing of an extend batch for the varlen flash kernel (on any
machine), and on CUDA the kernel's output against the per-request extend attention."""

from __future__ import annotations

import pytest
import torch

from radixserve.attention.base import AttentionSpec, ExtendMetadata
from radixserve.attention.extend import extend_attention
from radixserve.attention.torch_native import TorchNativeBackend
from radixserve.attention.varlen import (
    VarlenExtendMetadata,
    plan_varlen_extend,
    varlen_extend_attention,
    varlen_flash_available,
)
from radixserve.forward.batch import ExtendSegment, ForwardMode

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64


def _segments(prefixes: list[int], news: list[int], slots: int, device: str) -> list[ExtendSegment]:
    """Segments over distinct random pool slots (a prefix, then the new tokens')."""
    order = torch.randperm(slots, generator=torch.Generator().manual_seed(0)).to(device)
    segments, row, used = [], 0, 0
    for prefix, new in zip(prefixes, news, strict=True):
        context = order[used : used + prefix + new]
        used += prefix + new
        segments.append(ExtendSegment(row, new, prefix, context[:prefix], context))
        row += new
    return segments


def test_the_packing_holds_every_context_end_to_end_with_cumulative_lengths() -> None:
    segments = _segments([0, 5, 3], [4, 1, 2], 64, "cpu")
    plan = plan_varlen_extend(ForwardMode.EXTEND, segments, torch.device("cpu"))
    assert isinstance(plan, VarlenExtendMetadata)
    assert plan.cu_q.tolist() == [0, 4, 5, 7] and plan.cu_k.tolist() == [0, 4, 10, 15]
    assert plan.cu_q.dtype == torch.int32 and (plan.max_q, plan.max_k) == (4, 6)
    assert torch.equal(plan.context_slots, torch.cat([s.context_slots for s in segments]))  # type: ignore[misc]


def test_segments_without_context_slots_or_out_of_order_stay_on_the_per_request_path() -> None:
    segments = _segments([2, 0], [3, 3], 16, "cpu")
    unknown = [segments[0], ExtendSegment(3, 3, 0, segments[1].prefix_slots, None)]
    assert plan_varlen_extend(ForwardMode.EXTEND, unknown, torch.device("cpu")) is None
    assert plan_varlen_extend(ForwardMode.EXTEND, segments[::-1], torch.device("cpu")) is None


def test_the_kernel_is_only_offered_on_cuda_in_half_precision() -> None:
    assert varlen_flash_available(torch.device("cpu"), torch.bfloat16, 64) == "not a CUDA device"
    assert "fp16 and bf16" in str(varlen_flash_available(torch.device("cuda"), torch.float32, 64))
    assert "head_dim" in str(varlen_flash_available(torch.device("cuda"), torch.bfloat16, 20))


def _spec(dtype: torch.dtype) -> AttentionSpec:
    return AttentionSpec(1, HEADS, KV_HEADS, HEAD_DIM, dtype, torch.device("cuda"), None, 0)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen_flash_matches_the_per_request_extend_on_cuda(dtype: torch.dtype) -> None:
    generator = torch.Generator(device="cuda").manual_seed(1)
    slots = 4096
    prefixes, news = [0, 37, 512, 0, 129, 3], [64, 1, 33, 1, 200, 7]
    segments = _segments(prefixes, news, slots, "cuda")
    tokens = sum(news)
    q = torch.randn(tokens, HEADS, HEAD_DIM, device="cuda", dtype=dtype, generator=generator)
    k_cache = torch.randn(slots, KV_HEADS, HEAD_DIM, device="cuda", dtype=dtype, generator=generator)
    v_cache = torch.randn(slots, KV_HEADS, HEAD_DIM, device="cuda", dtype=dtype, generator=generator)
    # The new tokens' K/V, as the pool holds them.
    new_slots = torch.cat([s.context_slots[s.prefix_len :] for s in segments])  # type: ignore[index]
    k, v = k_cache[new_slots], v_cache[new_slots]
    scale = HEAD_DIM**-0.5
    plan = plan_varlen_extend(ForwardMode.EXTEND, segments, torch.device("cuda"))
    assert plan is not None
    got = varlen_extend_attention(q, k_cache, v_cache, plan, scale)
    # The reference in fp32: each request's SDPA with its lower-right causal mask.
    fp32 = [x.float() for x in (q, k, v, k_cache, v_cache)]
    want = extend_attention(*fp32, segments, scale)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    backend = TorchNativeBackend(_spec(dtype))
    assert backend.varlen_extend
    assert isinstance(backend.plan_extend(ForwardMode.EXTEND, segments), VarlenExtendMetadata)
    full = TorchNativeBackend(_spec(torch.float32))
    assert not full.varlen_extend
    assert type(full.plan_extend(ForwardMode.EXTEND, segments)) is ExtendMetadata
