"""Attention over the paged KV pool, in plain torch so it runs on any CPU and on CUDA.

Extend: one SDPA call per request. A prefill's work is large, so the per-call cost is small
next to its FLOPs, and each request sees exactly its own prefix plus its new tokens.

Decode: one query per request over contexts of different lengths. All contexts are flattened
into a single [total_context] index; each query is scored against its own segment, and the
softmax and the weighted sum over V are reduced per segment. The cost is O(total context),
whatever the mix of lengths, and there is one kernel sequence per layer however many requests run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixserve.model.forward_batch import DecodeLayout, ExtendSegment


def extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    segments: list[ExtendSegment],
    scale: float,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D] for the new tokens. Returns [T, H, D]."""
    heads, kv_heads = q.shape[1], k.shape[1]
    out = torch.empty_like(q)
    for seg in segments:
        rows = slice(seg.q_start, seg.q_start + seg.q_len)
        keys, values = k[rows], v[rows]
        if seg.prefix_len:
            keys = torch.cat((k_cache[seg.prefix_slots], keys))
            values = torch.cat((v_cache[seg.prefix_slots], values))
        out[rows] = _causal_sdpa(q[rows], keys, values, seg.prefix_len, heads // kv_heads, scale)
    return out


def _causal_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int, group: int, scale: float
) -> torch.Tensor:
    # [L, H, D] -> [H, L, D]; K/V heads are shared by `group` query heads (GQA).
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if group > 1:
        kh = kh.repeat_interleave(group, dim=0)
        vh = vh.repeat_interleave(group, dim=0)
    q_len = q.shape[0]
    if prefix_len == 0:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=q_len > 1, scale=scale)
    else:
        # New tokens sit at the end of the sequence: query i sees keys up to prefix_len + i.
        key_pos = torch.arange(prefix_len + q_len, device=q.device)
        query_pos = torch.arange(q_len, device=q.device) + prefix_len
        mask = key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layout: DecodeLayout,
    scale: float,
) -> torch.Tensor:
    """q: [B, H, D], one query per request. Returns [B, H, D]."""
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    seg = layout.segment_ids
    keys = k_cache[layout.kv_slots]  # [N, Hkv, D]
    values = v_cache[layout.kv_slots]
    # Each context token meets only its own request's query: [N, Hkv, group, D] · [N, Hkv, 1, D].
    q_per_token = q.view(batch, kv_heads, group, dim)[seg]
    scores = torch.matmul(q_per_token, keys.unsqueeze(-1)).squeeze(-1).float() * scale  # [N, Hkv, group]

    # Softmax within each request's segment, stabilized by the segment's max.
    seg_index = seg.view(-1, 1, 1).expand_as(scores)
    seg_max = torch.full((batch, kv_heads, group), float("-inf"), device=q.device)
    seg_max = seg_max.scatter_reduce(0, seg_index, scores, reduce="amax", include_self=True)
    weights = torch.exp(scores - seg_max[seg])
    seg_sum = torch.zeros((batch, kv_heads, group), device=q.device).index_add_(0, seg, weights)

    # Σ_n w[n] · V[n] per segment: [N, Hkv, group, 1] × [N, Hkv, 1, D] summed by segment.
    weighted = torch.matmul(weights.unsqueeze(-1), values.unsqueeze(2).float())
    out = torch.zeros((batch, kv_heads, group, dim), device=q.device).index_add_(0, seg, weighted)
    out = out / seg_sum.unsqueeze(-1)
    return out.view(batch, heads, dim).to(q.dtype)
