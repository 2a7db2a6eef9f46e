"""Helpers every attention backend shares: the shared-prefix test, query stacking, log-sum-exp merge."""

from __future__ import annotations

import itertools

import torch

from radixserve.forward.batch import DecodeLayout, ExtendSegment

# A prefix that every request of a group shares is attended once for all of them (cascade
# attention) when it is at least this long.
MIN_SHARED_PREFIX = 32


def shared_prefix_len(slots: torch.Tensor, shortest: int) -> int:
    """How many leading slots all rows have in common. Each row's last slot (its newest token) is
    its own, so at least one slot per row is left after the shared part."""
    same = (slots[:, : shortest - 1] == slots[:1, : shortest - 1]).all(0)
    return int(same.int().cumprod(0).sum())


def decode_shared_prefix(layout: DecodeLayout) -> torch.Tensor | None:
    """The KV slots every request's context starts with (at least MIN_SHARED_PREFIX of them, short
    of each request's newest token), or None."""
    if layout.batch_size < 2:
        return None
    shortest = int(layout.seq_lens.min())
    if shortest - 1 < MIN_SHARED_PREFIX:
        return None
    slots = layout.req_to_token[layout.req_pool_indices, : shortest - 1]
    shared = shared_prefix_len(slots, shortest)
    return slots[0, :shared] if shared >= MIN_SHARED_PREFIX else None


def shared_prefix_groups(segments: list[ExtendSegment]) -> list[list[int]]:
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


def stack_by_kv_head(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """q: [N, H, D] as [1, Hkv, N * G, D]: every query of a K/V head in one row block, so that one
    attention call per K/V head serves all N tokens over keys they all see (row n * G + g is token
    n's query g of that head)."""
    count, heads, dim = q.shape
    grouped = q.view(count, kv_heads, heads // kv_heads, dim)
    return grouped.permute(1, 0, 2, 3).reshape(1, kv_heads, count * (heads // kv_heads), dim)


def rows_of(segments: list[ExtendSegment]) -> slice | torch.Tensor:
    """The token rows of these segments: a slice when they are adjacent (a view, no gather)."""
    adjacent = all(a.q_start + a.q_len == b.q_start for a, b in itertools.pairwise(segments))
    if adjacent:
        return slice(segments[0].q_start, segments[-1].q_start + segments[-1].q_len)
    return torch.cat([torch.arange(s.q_start, s.q_start + s.q_len) for s in segments])


def visible_keys(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[queries, keys]: True where a query sees a key: at or before its own position, and, for a
    sliding layer, within its window: a query at position p sees positions p - window < j <= p
    (transformers' convention: the window counts the query's own position)."""
    keys, queries = key_pos.unsqueeze(0), query_pos.unsqueeze(1)
    seen = keys <= queries
    if window is not None:
        seen &= keys > queries - window
    return seen


def merge_by_lse(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """Attention over the union of two key sets from each set's output and log-sum-exp: each part
    weighted by its share of the total exp-sum. out: [..., D]; lse: [...]."""
    top = torch.maximum(lse_a, lse_b)
    weight_a = (lse_a - top).exp().unsqueeze(-1)
    weight_b = (lse_b - top).exp().unsqueeze(-1)
    merged = (out_a.float() * weight_a + out_b.float() * weight_b) / (weight_a + weight_b)
    return merged.to(out_a.dtype)
