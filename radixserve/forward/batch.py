"""ForwardBatch: the tensors one model step needs, built by the scheduler, read by the model."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from radixserve.attention.staging import StagedBucket, StagedPrefix


class ForwardMode(Enum):
    # Every request computes one or more new tokens on top of what its KV row already holds
    # (prefill, a prefill chunk, a resumed request, or a decode request mixed into a prefill).
    EXTEND = "extend"
    # Every request computes exactly one token.
    DECODE = "decode"


@dataclass
class ExtendSegment:
    """One request's slice of an extend batch."""

    q_start: int  # first row of this request in the flattened token dimension
    q_len: int  # new tokens computed now
    prefix_len: int  # tokens whose KV is already in the pool
    prefix_slots: torch.Tensor  # KV slots of the prefix, [prefix_len]
    # KV slots of the prefix and then of the new tokens, [prefix_len + q_len], when the batch builder
    # knows them (the native extend attention reads K/V through them).
    context_slots: torch.Tensor | None = None


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
    # Set by DecodeStaging just before the forward: the bucket's K/V kept contiguous across steps.
    staged: StagedBucket | None = None


@dataclass
class DecodeLayout:
    """Where each decode request's context lies: request b's K/V are at the KV slots
    req_to_token[req_pool_indices[b], :seq_lens[b]] (its new token's included). The native CPU
    kernel reads them in place; the torch path reads them through `buckets`, built on first use."""

    req_to_token: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    # Per row, an id that changes whenever the request's K/V may have changed (its admission serial,
    # new after each retraction): what decode staging keys its blocks on.
    request_ids: list[int]
    share_prefixes: bool = False
    # Set by PrefixStaging before the forward: the shared prefix's K/V kept between steps.
    staged_prefix: StagedPrefix | None = None

    @property
    def batch_size(self) -> int:
        return int(self.req_pool_indices.shape[0])

    @functools.cached_property
    def shared_prefix_slots(self) -> torch.Tensor | None:
        """The KV slots every request's context starts with (at least MIN_SHARED_PREFIX of them,
        short of each request's newest token), when prefix sharing is on; else None."""
        if not self.share_prefixes or self.batch_size < 2:
            return None
        shortest = int(self.seq_lens.min())
        if shortest - 1 < MIN_SHARED_PREFIX:
            return None
        slots = self.req_to_token[self.req_pool_indices, : shortest - 1]
        shared = _shared_prefix_len(slots, shortest)
        return slots[0, :shared] if shared >= MIN_SHARED_PREFIX else None

    @functools.cached_property
    def buckets(self) -> list[DecodeBucket]:
        return _build_buckets(self.req_to_token, self.req_pool_indices, self.seq_lens, self.share_prefixes)


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    out_cache_loc: torch.Tensor  # [num_tokens] KV slot each new token's K/V is written to
    # Rows of the flattened tokens whose logits are needed (the last token of each request that samples).
    sample_rows: torch.Tensor
    # More rows whose logits are needed, after the sampled ones: prompt positions for input logprobs.
    logprob_rows: torch.Tensor | None = None
    # Rows whose final hidden state (but no logits) is needed, after those: prompt positions of
    # requests that return hidden states.
    hidden_rows: torch.Tensor | None = None
    extend: list[ExtendSegment] | None = None
    decode: DecodeLayout | None = None
    # Rows whose input is a given vector rather than a token id's embedding: (first row, [n, H]).
    input_embeds: list[tuple[int, torch.Tensor]] | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


# A request joins the current bucket while its context is at least this fraction of the bucket's
# longest one, so padding wastes at most 1 - BUCKET_MIN_FILL of a bucket's work.
BUCKET_MIN_FILL = 0.75
# A prefix shared by every request of a bucket is attended once when it is at least this long.
MIN_SHARED_PREFIX = 32


def build_decode_layout(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    share_prefixes: bool = False,
    request_ids: list[int] | None = None,
) -> DecodeLayout:
    """The layout of a decode batch. request_ids defaults to the request slots, which suits a caller
    that never reuses a slot."""
    ids = req_pool_indices.tolist() if request_ids is None else list(request_ids)
    return DecodeLayout(req_to_token, req_pool_indices, seq_lens, ids, share_prefixes)


def _build_buckets(
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
        shared = _shared_prefix_len(slots, lens[group[-1]]) if share_prefixes and len(group) > 1 else 0
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
            )
        )
    return buckets


def _shared_prefix_len(slots: torch.Tensor, shortest: int) -> int:
    """How many leading slots all rows have in common. Each row's last slot (its newest token) is
    its own, so at least one slot per row is left after the shared part."""
    same = (slots[:, : shortest - 1] == slots[:1, : shortest - 1]).all(0)
    return int(same.int().cumprod(0).sum())
