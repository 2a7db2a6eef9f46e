"""Decode buckets: the torch backend's view of a decode batch.

Requests are sorted by context length and grouped into buckets whose shortest member is at least
BUCKET_MIN_FILL of its longest. Each bucket gathers its K/V with one index_select and runs one
batched SDPA, padded only to the bucket's own longest context (padding points at a real slot and
is masked). A fully flattened segment-softmax version was measured first: it materializes a copy
of the queries per context token and was far slower on a CPU (docs/architecture.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from radixserve.attention.common import MIN_SHARED_PREFIX, shared_prefix_len

# A request joins the current bucket while its context is at least this fraction of the bucket's
# longest one, so padding wastes at most 1 - BUCKET_MIN_FILL of a bucket's work.
BUCKET_MIN_FILL = 0.75


@dataclass
class DecodeBucket:
    """Requests of similar context length, padded only to the longest among them.

    When every request of the bucket starts with the same KV slots (a prefix they share through the
    radix cache), those are kept once in shared_slots, and kv_slots/mask/max_len describe only what
    follows: attention then reads the shared K/V once for all of them (cascade attention)."""

    rows: torch.Tensor | None  # which batch rows (None: all rows, in order)
    kv_slots: torch.Tensor  # [size * max_len] KV slots, request after request, padded with a valid slot
    mask: torch.Tensor | None  # [size, 1, 1, max_len] True where a slot is real; None when nothing is padded
    size: int
    max_len: int
    own_lens: torch.Tensor  # [size] context length of each row after the shared prefix
    shared_slots: torch.Tensor | None = None  # [shared_len] slots every request's context starts with
    shortest: int = 0  # the shortest own_lens entry (0: not known)
    # window_view's result per sliding window, made once per forward.
    _windowed: dict[int, tuple[int, torch.Tensor | None]] = field(default_factory=dict, repr=False)

    def window_view(self, window: int) -> tuple[int, torch.Tensor | None]:
        """A sliding layer's part of the bucket: the first column of kv_slots any row's query sees
        (its own last `window` positions), and the mask over the columns from there ([size, 1, 1,
        max_len - start], None when nothing is masked). Only without a shared prefix, whose keys
        each row would see a different part of."""
        assert self.shared_slots is None, "a sliding layer's decode takes no shared prefix"
        if window not in self._windowed:
            start = max(0, self.shortest - window)
            mask = self.mask if self.mask is None else self.mask[..., start:]
            if self.max_len - window > start:  # some row's window leaves out a column from start on
                columns = torch.arange(start, self.max_len, device=self.own_lens.device).unsqueeze(0)
                lens = self.own_lens.unsqueeze(1)
                mask = ((columns < lens) & (columns >= lens - window)).view(self.size, 1, 1, -1)
            self._windowed[window] = (start, mask)
        return self._windowed[window]


def build_buckets(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, share_prefixes: bool
) -> list[DecodeBucket]:
    """Groups requests by context length; each group becomes one batched attention call per layer.

    Padding every request to the longest context would make one 4k-token request cost every
    short request 4k tokens of attention; buckets keep the waste bounded with a handful of calls.
    """
    batch_size = int(req_pool_indices.shape[0])
    lens = seq_lens.tolist()
    order = sorted(range(batch_size), key=lambda i: -lens[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and lens[i] >= BUCKET_MIN_FILL * lens[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    buckets = []
    device = req_to_token.device
    for group in groups:
        max_len = lens[group[0]]
        rows = torch.tensor(group, dtype=torch.int64, device=device)
        slots = req_to_token[req_pool_indices[rows], :max_len]
        group_lens = seq_lens[rows]
        shared = shared_prefix_len(slots, lens[group[-1]]) if share_prefixes and len(group) > 1 else 0
        shared_slots = None
        if shared >= MIN_SHARED_PREFIX:
            shared_slots = slots[0, :shared]
            slots, group_lens, max_len = slots[:, shared:], group_lens - shared, max_len - shared
        mask: torch.Tensor | None = None
        if lens[group[-1]] != lens[group[0]]:
            valid = torch.arange(max_len, device=device).unsqueeze(0) < group_lens.unsqueeze(1)
            # Padding points at the request's own first slot: real data, so no NaN can leak in.
            slots = torch.where(valid, slots, slots[:, :1])
            mask = valid.view(len(group), 1, 1, max_len)
        in_order = len(groups) == 1 and group == list(range(batch_size))
        buckets.append(
            DecodeBucket(
                rows=None if in_order else rows,
                kv_slots=slots.reshape(-1),
                mask=mask,
                size=len(group),
                max_len=max_len,
                own_lens=group_lens,
                shared_slots=shared_slots,
                shortest=lens[group[-1]] - shared,
            )
        )
    return buckets
