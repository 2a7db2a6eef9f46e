"""ForwardBatch: the tensors one model step needs, built by the scheduler, read by the model."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum

import torch


class ForwardMode(Enum):
    # Every request computes one or more new tokens on top of what its KV row already holds
    # (prefill, a prefill chunk, a resumed request, or a decode request mixed into a prefill).
    EXTEND = "extend"
    # Every request computes exactly one token.
    DECODE = "decode"
    # Every request checks proposed tokens at once (speculative decoding's verify step): an extend
    # whose every position is sampled. The new tokens form a chain (causal) or a tree
    # (`ForwardBatch.verify_masks`), each token seeing its ancestors only.
    VERIFY = "verify"

    @property
    def is_extend_like(self) -> bool:
        """Attention runs causally over each request's new tokens and its cached context."""
        return self is not ForwardMode.DECODE


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
class DecodeLayout:
    """Where each decode request's context lies: request b's K/V are at the KV slots
    req_to_token[req_pool_indices[b], :seq_lens[b]] (its new token's included). Attention
    backends plan their own views of it (buckets, a shared prefix) once per forward."""

    req_to_token: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    # Per row, an id that changes whenever the request's K/V may have changed (its admission serial,
    # new after each retraction): what K/V kept between steps (attention/staging.py) is keyed on.
    request_ids: list[int]

    @property
    def batch_size(self) -> int:
        return int(self.req_pool_indices.shape[0])


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
    # VERIFY only, one per request: a [q_len, q_len] bool matrix, True where new token i may see
    # new token j (itself and its ancestors in the draft tree); None for a chain (plain causal).
    verify_masks: list[torch.Tensor | None] | None = None
    # --enable-lora: each adapter slot in use and the rows of the requests using it (layers/lora.py).
    lora_groups: list[tuple[int, torch.Tensor]] | None = None
    # With window slots (cache/swa_pool.py): slot -> window slot, by which the sliding-window
    # layers find their K/V (the scheduler's table, read as it is when the batch runs).
    window_map: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def build_decode_layout(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    request_ids: list[int] | None = None,
) -> DecodeLayout:
    """The layout of a decode batch. request_ids defaults to the request slots, which suits a caller
    that never reuses a slot."""
    ids = req_pool_indices.tolist() if request_ids is None else list(request_ids)
    return DecodeLayout(req_to_token, req_pool_indices, seq_lens, ids)


def window_view(batch: ForwardBatch) -> ForwardBatch:
    """The batch as the sliding-window layers address it when their K/V lie in window slots: every
    slot (new tokens', prefixes', each decode request's context) read through batch.window_map. A
    decode layout becomes one row per request, request b's in row b."""
    table = batch.window_map
    assert table is not None, "a batch without window slots"
    segments = None
    if batch.extend is not None:
        segments = [
            ExtendSegment(
                seg.q_start,
                seg.q_len,
                seg.prefix_len,
                table[seg.prefix_slots],
                None if seg.context_slots is None else table[seg.context_slots],
            )
            for seg in batch.extend
        ]
    decode = None
    if batch.decode is not None:
        layout = batch.decode
        longest = int(layout.seq_lens.max()) if layout.batch_size else 0
        rows = layout.req_to_token[layout.req_pool_indices, :longest]
        decode = DecodeLayout(
            table[rows],
            torch.arange(layout.batch_size, device=rows.device),
            layout.seq_lens,
            layout.request_ids,
        )
    return dataclasses.replace(
        batch, out_cache_loc=table[batch.out_cache_loc], extend=segments, decode=decode, window_map=None
    )
