"""Extend attention on CUDA as one varlen flash-attention call per layer.

torch_native's extend runs one SDPA per request, and a request with a cached prefix needs a
lower-right causal mask, which SDPA's flash kernel does not take: it fell back to the math kernel
(several kernels, fp32 upcasts) once per request and layer. On a GPU a forward's time is mostly the
host launching kernels, so that cost grew with the number of requests. The flash kernel's varlen
entry (`aten::_flash_attention_forward` with cumulative lengths) takes every request of the batch
in one call; its causal mask is aligned to the bottom right, so each request's new tokens see its
whole prefix. The K/V of every context are read out of the pool through one index per forward.
It takes fp16 and bf16 only; fp32 batches stay on the per-request path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.attention.base import ExtendMetadata
from radixserve.forward.batch import ExtendSegment, ForwardMode

FLASH_DTYPES = (torch.float16, torch.bfloat16)


def varlen_flash_available(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the varlen flash kernel cannot run extends here, or None when it can."""
    if device.type != "cuda":
        return "not a CUDA device"
    if dtype not in FLASH_DTYPES:
        return f"{dtype} (flash attention takes fp16 and bf16)"
    if head_dim % 8 or head_dim > 256:
        return f"head_dim {head_dim} (flash attention takes multiples of 8 up to 256)"
    if not torch.backends.cuda.flash_sdp_enabled():  # type: ignore[no-untyped-call]
        return "flash attention is disabled in torch"
    return None


@dataclass
class VarlenExtendMetadata(ExtendMetadata):
    """One extend forward's packing: every segment's context slots (prefix, then new tokens) end to
    end, and the cumulative query and context lengths the kernel takes."""

    context_slots: torch.Tensor
    cu_q: torch.Tensor  # int32 [segments + 1]
    cu_k: torch.Tensor  # int32 [segments + 1]
    max_q: int
    max_k: int


def plan_varlen_extend(
    mode: ForwardMode, segments: list[ExtendSegment], device: torch.device
) -> VarlenExtendMetadata | None:
    """The packing, or None when a segment's context slots are unknown or segments are not in
    query order (the per-request path takes those)."""
    slots: list[torch.Tensor] = []
    q_lens: list[int] = []
    k_lens: list[int] = []
    row = 0
    for seg in segments:
        if seg.context_slots is None or seg.q_start != row:
            return None
        slots.append(seg.context_slots)
        q_lens.append(seg.q_len)
        k_lens.append(seg.prefix_len + seg.q_len)
        row += seg.q_len
    lengths = torch.tensor([[0, 0], *zip(q_lens, k_lens, strict=True)], dtype=torch.int32)
    cumulative = lengths.cumsum(0, dtype=torch.int32).to(device, non_blocking=True)
    return VarlenExtendMetadata(
        mode,
        segments,
        context_slots=torch.cat(slots).to(device, non_blocking=True),
        cu_q=cumulative[:, 0].contiguous(),
        cu_k=cumulative[:, 1].contiguous(),
        max_q=max(q_lens),
        max_k=max(k_lens),
    )


def varlen_extend_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: VarlenExtendMetadata, scale: float
) -> torch.Tensor:
    """q: [T, H, D] (the new tokens' K/V already in the pool). Returns [T, H, D]."""
    keys = k_cache.index_select(0, plan.context_slots)
    values = v_cache.index_select(0, plan.context_slots)
    flash = torch.ops.aten._flash_attention_forward
    causal, debug_mask = True, False
    lengths = (plan.cu_q, plan.cu_k, plan.max_q, plan.max_k)
    out: torch.Tensor = flash(q.contiguous(), keys, values, *lengths, 0.0, causal, debug_mask, scale=scale)[0]
    return out
