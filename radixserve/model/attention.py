"""Attention over the paged KV pool, in plain torch so it runs on any CPU and on CUDA.

Extend: one SDPA call per request. A prefill's work is large, so the per-call cost is small
next to its FLOPs, and each request sees exactly its own prefix plus its new tokens.

Decode: one query per request over contexts of different lengths. Requests are grouped into
buckets of similar length (see build_decode_layout); each bucket gathers its K/V with one
index_select and runs one batched SDPA, padded only to the bucket's longest context. With all
lengths equal that is a single call per layer; with a wide mix, a few calls and at most ~25%
padding. (A fully flattened segment-softmax version was measured first: it materializes a copy
of the queries per context token and was ~9x slower on CPU.)

Cascade (CPU): when all requests of a bucket share a prefix of KV slots (the radix cache gives
requests with a common prompt prefix the same slots), the shared part is gathered once and every
query attends to it in one call; the per-request rest is attended separately, and the two partial
results are merged by their log-sum-exp. Decode attention is memory-bound, so reading a 512-token
shared prefix once instead of 32 times made the layer ~3x faster (32 requests, 512 shared + 48).
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
    if bucket.shared_slots is not None:
        return _cascade_attention(q, k_cache, v_cache, bucket, bucket.shared_slots, scale)
    _, kv_heads, dim = k_cache.shape
    shape = (bucket.size, bucket.max_len, kv_heads, dim)
    keys = k_cache.index_select(0, bucket.kv_slots).view(shape).transpose(1, 2)
    values = v_cache.index_select(0, bucket.kv_slots).view(shape).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), keys, values, attn_mask=bucket.mask, scale=scale, enable_gqa=True
    )
    return out.squeeze(2)


def _cascade_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    bucket: DecodeBucket,
    shared_slots: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q: [B, H, D]. Attention over shared prefix + own suffix, merged by log-sum-exp (CPU op)."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    size, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    # Queries grouped by their K/V head: [B, Hkv, G, D]. No GQA expansion is needed then.
    grouped = q.view(size, kv_heads, group, dim)

    # Shared part: every query of a K/V head attends to the same keys, one call for all requests.
    shared_k = k_cache.index_select(0, shared_slots).transpose(0, 1).unsqueeze(0)
    shared_v = v_cache.index_select(0, shared_slots).transpose(0, 1).unsqueeze(0)
    stacked = grouped.permute(1, 0, 2, 3).reshape(1, kv_heads, size * group, dim)
    shared_out, shared_lse = flash(stacked, shared_k, shared_v, 0.0, False, scale=scale)
    shared_out = shared_out.view(kv_heads, size, group, dim).permute(1, 0, 2, 3)
    shared_lse = shared_lse.view(kv_heads, size, group).permute(1, 0, 2)

    # Each request's own part.
    shape = (size, bucket.max_len, kv_heads, dim)
    own_k = k_cache.index_select(0, bucket.kv_slots).view(shape).transpose(1, 2)
    own_v = v_cache.index_select(0, bucket.kv_slots).view(shape).transpose(1, 2)
    mask = None
    if bucket.mask is not None:
        # This kernel takes an additive mask in the query's dtype.
        mask = torch.zeros(bucket.mask.shape, dtype=q.dtype, device=q.device)
        mask.masked_fill_(~bucket.mask, float("-inf"))
    own_out, own_lse = flash(grouped, own_k, own_v, 0.0, False, attn_mask=mask, scale=scale)

    # Softmax over the union = each part weighted by its share of the total exp-sum.
    top = torch.maximum(shared_lse, own_lse)
    shared_w = (shared_lse - top).exp().unsqueeze(-1)
    own_w = (own_lse - top).exp().unsqueeze(-1)
    merged = (shared_out.float() * shared_w + own_out.float() * own_w) / (shared_w + own_w)
    return merged.to(q.dtype).reshape(size, heads, dim)
