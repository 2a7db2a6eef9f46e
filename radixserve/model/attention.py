"""Attention over the paged KV pool, in plain torch so it runs on any CPU and on CUDA.

Extend: one SDPA call per request. A prefill's work is large, so the per-call cost is small
next to its FLOPs, and each request sees exactly its own prefix plus its new tokens.

Decode: one query per request over contexts of different lengths. Requests are grouped into
buckets of similar length (see build_decode_layout); each bucket gathers its K/V with one
index_select and runs one batched SDPA, padded only to the bucket's longest context. With all
lengths equal that is a single call per layer; with a wide mix, a few calls and at most ~25%
padding. (A fully flattened segment-softmax version was measured first: it materializes a copy
of the queries per context token and was ~9x slower on CPU.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixserve.model.forward_batch import DecodeBucket, DecodeLayout, ExtendSegment


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
    out = torch.empty_like(q)
    for seg in segments:
        rows = slice(seg.q_start, seg.q_start + seg.q_len)
        keys, values = k[rows], v[rows]
        if seg.prefix_len:
            keys = torch.cat((k_cache.index_select(0, seg.prefix_slots), keys))
            values = torch.cat((v_cache.index_select(0, seg.prefix_slots), values))
        out[rows] = _causal_sdpa(q[rows], keys, values, seg.prefix_len, scale)
    return out


def _causal_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int, scale: float
) -> torch.Tensor:
    # [L, H, D] -> [1, H, L, D]: the CPU flash kernel takes only 4-D inputs (3-D falls back to the
    # ~3x slower math path). SDPA maps each group of query heads onto its K/V head (GQA).
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    q_len = q.shape[0]
    if prefix_len == 0:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=q_len > 1, scale=scale, enable_gqa=True)
    else:
        # New tokens sit at the end of the sequence: query i sees keys up to prefix_len + i.
        key_pos = torch.arange(prefix_len + q_len, device=q.device)
        query_pos = torch.arange(q_len, device=q.device) + prefix_len
        mask = key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layout: DecodeLayout,
    scale: float,
) -> torch.Tensor:
    """q: [B, H, D], one query per request. Returns [B, H, D]."""
    if len(layout.buckets) == 1 and layout.buckets[0].rows is None:
        return _bucket_attention(q, k_cache, v_cache, layout.buckets[0], scale)
    out = torch.empty_like(q)
    for bucket in layout.buckets:
        assert bucket.rows is not None
        out[bucket.rows] = _bucket_attention(q[bucket.rows], k_cache, v_cache, bucket, scale)
    return out


def _bucket_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, bucket: DecodeBucket, scale: float
) -> torch.Tensor:
    _, kv_heads, dim = k_cache.shape
    shape = (bucket.size, bucket.max_len, kv_heads, dim)
    keys = k_cache.index_select(0, bucket.kv_slots).view(shape).transpose(1, 2)
    values = v_cache.index_select(0, bucket.kv_slots).view(shape).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), keys, values, attn_mask=bucket.mask, scale=scale, enable_gqa=True
    )
    return out.squeeze(2)
