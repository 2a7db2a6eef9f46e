"""Attention over the paged KV pool, in plain torch so it runs on any CPU and on CUDA.

Extend: one SDPA call per request. A prefill's work is large, so the per-call cost is small
next to its FLOPs, and each request sees exactly its own prefix plus its new tokens.

Decode: one query per request over contexts of different lengths. Requests are grouped into
buckets of similar length (see build_decode_layout); each bucket gathers its K/V with one
index_select and runs one batched SDPA, padded only to the bucket's longest context. With all
lengths equal that is a single call per layer; with a wide mix, a few calls and at most ~25%
padding. (A fully flattened segment-softmax version was measured first: it materializes a copy
of the queries per context token and was ~9x slower on CPU.)

Cascade (CPU): in extend, requests whose cached prefixes are the same slots attend to that prefix
in one call (their own new tokens in another) instead of each gathering it. In decode, when all
requests of a bucket share a prefix of KV slots (the radix cache gives
requests with a common prompt prefix the same slots), the shared part is gathered once and every
query attends to it in one call; the per-request rest is attended separately, and the two partial
results are merged by their log-sum-exp. Decode attention is memory-bound, so reading a 512-token
shared prefix once instead of 32 times made the layer ~3x faster (32 requests, 512 shared + 48).

With the native CPU kernels loaded (radixserve/kernels), decode skips the buckets: the kernel reads
each request's K/V in place from the pool, and a prefix shared by the whole batch is attended here
in one call and merged in by the kernel. Extend merges its cascade parts with the native kernel too.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from radixserve.attention.staging import bucket_kv, shared_kv
from radixserve.forward.batch import MIN_SHARED_PREFIX, DecodeBucket, DecodeLayout, ExtendSegment
from radixserve.kernels.cpu_ops import CpuKernels, SharedPrefixResult


def extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    segments: list[ExtendSegment],
    scale: float,
    kernels: CpuKernels | None = None,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D] for the new tokens. Returns [T, H, D]."""
    out = torch.empty_like(q)
    done: set[int] = set()
    if q.device.type == "cpu":
        for group in _shared_prefix_groups(segments):
            _cascade_extend(q, k, v, k_cache, v_cache, [segments[i] for i in group], scale, out, kernels)
            done.update(group)
    for index, seg in enumerate(segments):
        if index in done:
            continue
        rows = slice(seg.q_start, seg.q_start + seg.q_len)
        if kernels is not None and seg.context_slots is not None:
            native = kernels.causal_attention(
                q[rows], k_cache, v_cache, seg.context_slots, seg.prefix_len, scale
            )
            if native is not None:
                out[rows] = native
                continue
        keys, values = k[rows], v[rows]
        if seg.prefix_len:
            keys = torch.cat((k_cache.index_select(0, seg.prefix_slots), keys))
            values = torch.cat((v_cache.index_select(0, seg.prefix_slots), values))
        out[rows] = _causal_sdpa(q[rows], keys, values, seg.prefix_len, scale)
    return out


def _shared_prefix_groups(segments: list[ExtendSegment]) -> list[list[int]]:
    """Segments (two or more) whose cached prefixes are the very same KV slots."""
    by_prefix: dict[tuple[int, int, int], list[int]] = {}
    for index, seg in enumerate(segments):
        if seg.prefix_len >= MIN_SHARED_PREFIX:
            key = (seg.prefix_len, int(seg.prefix_slots[0]), int(seg.prefix_slots[-1]))
            by_prefix.setdefault(key, []).append(index)
    groups = []
    for members in by_prefix.values():
        first = segments[members[0]].prefix_slots
        same = [i for i in members if torch.equal(segments[i].prefix_slots, first)]
        if len(same) > 1:
            groups.append(same)
    return groups


def _cascade_extend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: list[ExtendSegment],
    scale: float,
    out: torch.Tensor,
    kernels: CpuKernels | None,
) -> None:
    """Segments sharing a cached prefix: all their new tokens attend to the prefix in one call
    (every prefix position precedes them, so no mask), each segment causally to its own new
    tokens, and the two parts are merged by log-sum-exp. Writes the rows of out."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    _, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    per_head = heads // kv_heads
    rows = _rows_of(group)
    count = sum(s.q_len for s in group)
    queries = q[rows]
    # Shared part: queries grouped by their K/V head, [1, Hkv, rows * G, D] against the prefix.
    slots = group[0].prefix_slots
    prefix_k, prefix_v = k_cache.index_select(0, slots), v_cache.index_select(0, slots)
    shared = None if kernels is None else kernels.prefix_attention(queries, prefix_k, prefix_v, scale)
    if shared is not None:
        shared_out, shared_lse = shared.out, shared.lse
    else:
        stacked = _stack_by_kv_head(queries, kv_heads)
        prefix_k, prefix_v = (x.transpose(0, 1).unsqueeze(0) for x in (prefix_k, prefix_v))
        shared_out, shared_lse = flash(stacked, prefix_k, prefix_v, 0.0, False, scale=scale)
    # [rows, Hkv, G, D] and [rows, Hkv, G] views: the queries' order again.
    shared_out = shared_out.view(kv_heads, count, per_head, dim).permute(1, 0, 2, 3)
    shared_lse = shared_lse.view(kv_heads, count, per_head).permute(1, 0, 2)
    # Own part: causal over the segment's new tokens (one call when they are all as long).
    lengths = {s.q_len for s in group}
    parts = [group] if len(lengths) == 1 else [[s] for s in group]
    own_out, own_lse = [], []
    for part in parts:
        length = part[0].q_len
        part_rows = _rows_of(part)
        shape = (len(part), length)
        part_q = q[part_rows].view(*shape, heads, dim).transpose(1, 2)
        part_k = k[part_rows].view(*shape, kv_heads, dim).transpose(1, 2).repeat_interleave(per_head, dim=1)
        part_v = v[part_rows].view(*shape, kv_heads, dim).transpose(1, 2).repeat_interleave(per_head, dim=1)
        o, lse = flash(part_q, part_k, part_v, 0.0, True, scale=scale)
        own_out.append(o.transpose(1, 2).reshape(-1, heads, dim))
        own_lse.append(lse.transpose(1, 2).reshape(-1, heads))
    own = torch.cat(own_out).view(count, kv_heads, per_head, dim)
    own_lse_grouped = torch.cat(own_lse).view(count, kv_heads, per_head)
    merged = None if kernels is None else kernels.merge_by_lse(shared_out, shared_lse, own, own_lse_grouped)
    if merged is None:
        merged = _merge_by_lse(
            shared_out.reshape(count, heads, dim),
            shared_lse.reshape(count, heads),
            own.view(count, heads, dim),
            own_lse_grouped.view(count, heads),
        )
    out[rows] = merged


def _stack_by_kv_head(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """q: [N, H, D] as [1, Hkv, N * G, D]: every query of a K/V head in one row block, so that one
    attention call per K/V head serves all N tokens over keys they all see (row n * G + g is token
    n's query g of that head)."""
    count, heads, dim = q.shape
    grouped = q.view(count, kv_heads, heads // kv_heads, dim)
    return grouped.permute(1, 0, 2, 3).reshape(1, kv_heads, count * (heads // kv_heads), dim)


def _rows_of(segments: list[ExtendSegment]) -> slice | torch.Tensor:
    """The token rows of these segments: a slice when they are adjacent (a view, no gather)."""
    adjacent = all(a.q_start + a.q_len == b.q_start for a, b in itertools.pairwise(segments))
    if adjacent:
        return slice(segments[0].q_start, segments[-1].q_start + segments[-1].q_len)
    return torch.cat([torch.arange(s.q_start, s.q_start + s.q_len) for s in segments])


def _merge_by_lse(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """Attention over the union of two key sets from each set's output and log-sum-exp: each part
    weighted by its share of the total exp-sum. out: [..., D]; lse: [...]."""
    top = torch.maximum(lse_a, lse_b)
    weight_a = (lse_a - top).exp().unsqueeze(-1)
    weight_b = (lse_b - top).exp().unsqueeze(-1)
    merged = (out_a.float() * weight_a + out_b.float() * weight_b) / (weight_a + weight_b)
    return merged.to(out_a.dtype)


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
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layout: DecodeLayout,
    layer_id: int,
    scale: float,
    kernels: CpuKernels | None = None,
) -> torch.Tensor:
    """q: [B, H, D], one query per request; k, v: [B, Hkv, D], the new tokens' (already written
    to the pool). Returns [B, H, D]."""
    if kernels is not None and kernels.handles_decode_attention(
        q.shape[1], k_cache.shape[1], q.shape[2], q.dtype
    ):
        prefix = None
        if layout.shared_prefix_slots is not None and q.device.type == "cpu":
            prefix = _shared_prefix_attention(q, k_cache, v_cache, layout, layer_id, scale, kernels)
        native = kernels.decode_attention(
            q, k_cache, v_cache, layout.req_to_token, layout.req_pool_indices, layout.seq_lens, scale, prefix
        )
        if native is not None:
            return native
    if len(layout.buckets) == 1 and layout.buckets[0].rows is None:
        return _bucket_attention(q, k, v, k_cache, v_cache, layout.buckets[0], layer_id, scale)
    out = torch.empty_like(q)
    for bucket in layout.buckets:
        assert bucket.rows is not None
        rows = bucket.rows
        out[rows] = _bucket_attention(q[rows], k[rows], v[rows], k_cache, v_cache, bucket, layer_id, scale)
    return out


def _shared_prefix_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layout: DecodeLayout,
    layer_id: int,
    scale: float,
    kernels: CpuKernels,
) -> SharedPrefixResult:
    """Every query of the batch over the prefix all requests share, in one call per K/V head group:
    the prefix is read once instead of once per request, and the call is GEMM-shaped (on AMX tiles
    where the CPU has them, else torch's flash kernel). The native decode kernel attends the rest
    and merges this in by log-sum-exp (cascade attention)."""
    slots = layout.shared_prefix_slots
    assert slots is not None
    if layout.staged_prefix is not None:
        keys, values = layout.staged_prefix.layer_kv(layer_id, k_cache, v_cache)
    else:
        keys, values = k_cache.index_select(0, slots), v_cache.index_select(0, slots)
    native = kernels.prefix_attention(q, keys, values, scale)
    if native is not None:
        return native
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    stacked = _stack_by_kv_head(q, k_cache.shape[1])
    keys, values = keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)
    out, lse = flash(stacked, keys, values, 0.0, False, scale=scale)
    return SharedPrefixResult(int(slots.shape[0]), out[0], lse[0].contiguous())


def _bucket_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    bucket: DecodeBucket,
    layer_id: int,
    scale: float,
) -> torch.Tensor:
    keys, values = bucket_kv(bucket, layer_id, k_cache, v_cache, k, v)
    if bucket.shared_slots is not None:
        return _cascade_attention(q, keys, values, bucket, layer_id, k_cache, v_cache, scale)
    size, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    # Queries grouped by their K/V head, [B, Hkv, G, D], as G query rows over the same keys: one
    # pass over each K/V head instead of one per query head (~10% faster than enable_gqa here).
    grouped = q.view(size, kv_heads, heads // kv_heads, dim)
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=bucket.mask, scale=scale)
    return out.reshape(size, heads, dim)


def _cascade_attention(
    q: torch.Tensor,
    own_k: torch.Tensor,
    own_v: torch.Tensor,
    bucket: DecodeBucket,
    layer_id: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
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
    shared_k, shared_v = shared_kv(bucket, layer_id, k_cache, v_cache)
    stacked = _stack_by_kv_head(q, kv_heads)
    shared_out, shared_lse = flash(stacked, shared_k, shared_v, 0.0, False, scale=scale)
    shared_out = shared_out.view(kv_heads, size, group, dim).permute(1, 0, 2, 3)
    shared_lse = shared_lse.view(kv_heads, size, group).permute(1, 0, 2)

    # Each request's own part.
    mask = None
    if bucket.mask is not None:
        # This kernel takes an additive mask in the query's dtype.
        mask = torch.zeros(bucket.mask.shape, dtype=q.dtype, device=q.device)
        mask.masked_fill_(~bucket.mask, float("-inf"))
    own_out, own_lse = flash(grouped, own_k, own_v, 0.0, False, attn_mask=mask, scale=scale)

    return _merge_by_lse(shared_out, shared_lse, own_out, own_lse).reshape(size, heads, dim)
