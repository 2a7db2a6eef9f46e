"""ForwardBatch: the tensors one model step needs, built by the scheduler, read by the model."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch


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


@dataclass
class DecodeLayout:
    """All requests' contexts flattened into one index, so decode attention needs no padding."""

    kv_slots: torch.Tensor  # [total_context] KV slots, request after request
    segment_ids: torch.Tensor  # [total_context] which request each slot belongs to
    batch_size: int


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    out_cache_loc: torch.Tensor  # [num_tokens] KV slot each new token's K/V is written to
    # Rows of the flattened tokens whose logits are needed (the last token of each request that samples).
    sample_rows: torch.Tensor
    extend: list[ExtendSegment] | None = None
    decode: DecodeLayout | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def build_decode_layout(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor
) -> DecodeLayout:
    """Gather every request's KV slots [0, seq_len) into one flat index, without a Python loop."""
    batch_size = int(req_pool_indices.shape[0])
    max_len = int(seq_lens.max())
    rows = req_to_token[req_pool_indices, :max_len]
    valid = torch.arange(max_len, device=rows.device).unsqueeze(0) < seq_lens.unsqueeze(1)
    segment_ids = torch.arange(batch_size, device=rows.device).unsqueeze(1).expand(-1, max_len)
    return DecodeLayout(kv_slots=rows[valid], segment_ids=segment_ids[valid], batch_size=batch_size)
