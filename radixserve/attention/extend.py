"""Extend attention over the paged KV pool (prefill, prefill chunks, mixed batches, verify steps).

One SDPA call per request: a prefill's work is large, so the per-call cost is small next to its
FLOPs, and each request sees exactly its own prefix plus its new tokens. On a CPU, requests whose
cached prefixes are the very same KV slots (the radix cache gives requests with a common prompt
prefix the same slots) attend to that prefix in one call and to their own new tokens in another,
and the two are merged by log-sum-exp (cascade attention). A sliding-window layer (a window) runs
one masked SDPA per request over only the keys its queries see, in blocks of queries (no cascade:
each query sees a different part of the prefix).

`CpuAttentionOps` carries the native kernels a backend chose at startup: the prefix attention kernel
(AMX tiles or vector FMAs) for the shared part, AMX tiles for single requests, and the native merge.
Without them every part runs on torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixserve.attention.common import (
    merge_by_lse,
    rows_of,
    shared_prefix_groups,
    stack_by_kv_head,
    visible_keys,
)
from radixserve.forward.batch import ExtendSegment
from radixserve.kernels.cpu_ops import CpuKernels


@dataclass(frozen=True)
class CpuAttentionOps:
    """Native kernels an attention backend uses, chosen once at startup."""

    kernels: CpuKernels
    # The native kernel of the queries' attention over a shared prefix (and with "amx", of one
    # request's causal extend): "amx" or "vector" (CpuKernels.prefix_attention_kernel), or None.
    prefix_kernel: str | None


def extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    segments: list[ExtendSegment],
    scale: float,
    ops: CpuAttentionOps | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D] for the new tokens (already in the pool). Returns [T, H, D].
    window: a sliding layer's window (a query at position p sees positions p - window < j <= p)."""
    out = torch.empty_like(q)
    done: set[int] = set()
    if q.device.type == "cpu" and window is None:
        for group in shared_prefix_groups(segments):
            _cascade_extend(q, k, v, k_cache, v_cache, [segments[i] for i in group], scale, out, ops)
            done.update(group)
    for index, seg in enumerate(segments):
        if index in done:
            continue
        rows = slice(seg.q_start, seg.q_start + seg.q_len)
        # The vector kernel's causal mode is not taken here (docs/architecture.md, "Vector prefix
        # attention", says why): only AMX tiles replace torch's kernel for a single request.
        if (
            window is None
            and ops is not None
            and ops.prefix_kernel == "amx"
            and seg.context_slots is not None
        ):
            native = ops.kernels.causal_attention(
                q[rows], k_cache, v_cache, seg.context_slots, seg.prefix_len, scale, ops.prefix_kernel
            )
            if native is not None:
                out[rows] = native
                continue
        first = window_start(seg.prefix_len, window)
        keys, values = _context_kv(k, v, k_cache, v_cache, seg, rows, first)
        out[rows] = _causal_sdpa(q[rows], keys, values, seg.prefix_len, scale, window, first)
    return out


def window_start(prefix_len: int, window: int | None) -> int:
    """The first context position that a request's first new token (at prefix_len) sees: 0 without
    a window. No later token sees further back."""
    return 0 if window is None else max(0, prefix_len - window + 1)


def _context_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seg: ExtendSegment,
    rows: slice,
    first: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A segment's keys and values from context position `first` on: its cached prefix's (gathered
    from the pool), then its new tokens'."""
    keys, values = k[rows], v[rows]
    if seg.prefix_len > first:
        slots = seg.prefix_slots[first:]
        keys = torch.cat((k_cache.index_select(0, slots), keys))
        values = torch.cat((v_cache.index_select(0, slots), values))
    return keys, values


def _cascade_extend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: list[ExtendSegment],
    scale: float,
    out: torch.Tensor,
    ops: CpuAttentionOps | None,
) -> None:
    """Segments sharing a cached prefix: all their new tokens attend to the prefix in one call
    (every prefix position precedes them, so no mask), each segment causally to its own new
    tokens, and the two parts are merged by log-sum-exp. Writes the rows of out."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    _, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    per_head = heads // kv_heads
    rows = rows_of(group)
    count = sum(s.q_len for s in group)
    queries = q[rows]
    # Shared part: queries grouped by their K/V head, [1, Hkv, rows * G, D] against the prefix.
    slots = group[0].prefix_slots
    prefix_k, prefix_v = k_cache.index_select(0, slots), v_cache.index_select(0, slots)
    shared = None
    if ops is not None and ops.prefix_kernel is not None:
        shared = ops.kernels.prefix_attention(queries, prefix_k, prefix_v, scale, ops.prefix_kernel)
    if shared is not None:
        shared_out, shared_lse = shared.out, shared.lse
    else:
        stacked = stack_by_kv_head(queries, kv_heads)
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
        part_rows = rows_of(part)
        shape = (len(part), length)
        part_q = q[part_rows].view(*shape, heads, dim).transpose(1, 2)
        part_k = k[part_rows].view(*shape, kv_heads, dim).transpose(1, 2).repeat_interleave(per_head, dim=1)
        part_v = v[part_rows].view(*shape, kv_heads, dim).transpose(1, 2).repeat_interleave(per_head, dim=1)
        o, lse = flash(part_q, part_k, part_v, 0.0, True, scale=scale)
        own_out.append(o.transpose(1, 2).reshape(-1, heads, dim))
        own_lse.append(lse.transpose(1, 2).reshape(-1, heads))
    own = torch.cat(own_out).view(count, kv_heads, per_head, dim)
    own_lse_grouped = torch.cat(own_lse).view(count, kv_heads, per_head)
    merged = None if ops is None else ops.kernels.merge_by_lse(shared_out, shared_lse, own, own_lse_grouped)
    if merged is None:
        merged = merge_by_lse(
            shared_out.reshape(count, heads, dim),
            shared_lse.reshape(count, heads),
            own.view(count, heads, dim),
            own_lse_grouped.view(count, heads),
        )
    out[rows] = merged


def tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    segments: list[ExtendSegment],
    masks: list[torch.Tensor | None],
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """A verify step's attention when drafts form trees: new token i of a segment sees the cached
    prefix and the new tokens masks[s][i] marks (itself and its ancestors); a None mask is causal.
    With a window, a node at depth d (position prefix_len + d) sees only the positions within the
    window before it, its ancestors' included. One masked SDPA per request: a verify step has a
    handful of tokens per request."""
    out = torch.empty_like(q)
    for seg, tree in zip(segments, masks, strict=True):
        rows = slice(seg.q_start, seg.q_start + seg.q_len)
        first = window_start(seg.prefix_len, window)
        keys, values = _context_kv(k, v, k_cache, v_cache, seg, rows, first)
        if tree is None:
            out[rows] = _causal_sdpa(q[rows], keys, values, seg.prefix_len, scale, window, first)
            continue
        tree = tree.to(q.device)
        seen = torch.ones(seg.q_len, seg.prefix_len - first + seg.q_len, dtype=torch.bool, device=q.device)
        seen[:, seg.prefix_len - first :] = tree
        if window is not None:
            # A node sees its depth + 1 nodes (its ancestors and itself); every key it may see is
            # at or before its position, so the causal part of the test changes nothing.
            node_pos = seg.prefix_len + tree.sum(dim=1) - 1
            prefix_pos = torch.arange(first, seg.prefix_len, device=q.device)
            seen &= visible_keys(node_pos, torch.cat((prefix_pos, node_pos)), window)
        qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q[rows], keys, values))
        attended = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=seen, scale=scale, enable_gqa=True)
        out[rows] = attended.squeeze(0).transpose(0, 1)
    return out


# A sliding layer's extend attends in blocks of at least this many queries (and of its window, if
# longer): each block's scores and mask cover its queries over the window before them, so they stay
# bounded however long the prompt.
MIN_WINDOW_BLOCK = 256


def _causal_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_len: int,
    scale: float,
    window: int | None = None,
    first: int = 0,
) -> torch.Tensor:
    """q: [L, H, D] at positions prefix_len..; k, v: [S, Hkv, D] at positions first.. through the
    last query's. Each query sees the keys up to its own position (and within the window)."""
    q_len = q.shape[0]
    if window is not None and prefix_len + q_len > window:
        return _windowed_sdpa(q, k, v, prefix_len, scale, window, first)
    # [L, H, D] -> [1, H, L, D]: the CPU flash kernel takes only 4-D inputs (3-D falls back to the
    # much slower math path). SDPA maps each group of query heads onto its K/V head (GQA).
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    if prefix_len == 0:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=q_len > 1, scale=scale, enable_gqa=True)
    else:
        # New tokens sit at the end of the sequence: query i sees keys up to prefix_len + i.
        key_pos = torch.arange(prefix_len + q_len, device=q.device)
        query_pos = torch.arange(q_len, device=q.device) + prefix_len
        mask = visible_keys(query_pos, key_pos, None)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


def _windowed_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int, scale: float, window: int, first: int
) -> torch.Tensor:
    """_causal_sdpa's sliding-window case, one masked SDPA per block of queries over the keys the
    block sees (from the window before its first query through its last)."""
    q_len = q.shape[0]
    out = torch.empty_like(q)
    block = max(window, MIN_WINDOW_BLOCK)
    for start in range(0, q_len, block):
        end = min(q_len, start + block)
        low = max(first, prefix_len + start - window + 1)  # the oldest position the block sees
        high = prefix_len + end  # one past its newest
        query_pos = torch.arange(prefix_len + start, high, device=q.device)
        mask = visible_keys(query_pos, torch.arange(low, high, device=q.device), window)
        keys, values = k[low - first : high - first], v[low - first : high - first]
        qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q[start:end], keys, values))
        attended = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:end] = attended.squeeze(0).transpose(0, 1)
    return out
