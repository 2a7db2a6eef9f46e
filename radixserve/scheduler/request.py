"""Req: one generation request as the scheduler tracks it, and the reasons it can finish."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from radixserve.cache.radix_cache import TreeNode
from radixserve.messages import FinishReason
from radixserve.sampling_params import SamplingParams

_arrival_counter = itertools.count()


@dataclass(eq=False)
class Req:
    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    output_ids: list[int] = field(default_factory=list)
    arrival: int = field(default_factory=lambda: next(_arrival_counter))
    finished_reason: FinishReason | None = None

    # KV ownership (see cache/radix_cache.py): positions [0, cached_len) belong to the radix tree
    # and are locked through last_node; [cached_len, kv_len) belong to this request.
    req_pool_idx: int | None = None
    cached_len: int = 0
    kv_len: int = 0
    # The scheduler passes the cache's root; a node of its own only stands in until then.
    last_node: TreeNode = field(default_factory=TreeNode)

    # Set by the prefill adder for the next extend: the cached prefix found for fill_ids and
    # how many of the remaining tokens this step computes.
    prefix_slots: torch.Tensor | None = None
    prefix_node: TreeNode | None = None
    extend_len: int = 0

    # Prompt tokens served from the cache, and how far this request has computed on its own
    # (so that resuming after retraction or a chunk does not count its own KV as a cache hit).
    cached_tokens: int = 0
    computed_len: int = 0
    retractions: int = 0
    generator: torch.Generator | None = None

    @property
    def fill_ids(self) -> list[int]:
        """Every token whose KV a resumed request must have: the prompt and what it has output."""
        return self.origin_input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def remaining_new_tokens(self) -> int:
        return max(0, self.sampling_params.max_new_tokens - len(self.output_ids))

    def check_finished(self, context_len: int) -> None:
        if self.finished_reason is not None or not self.output_ids:
            return
        last = self.output_ids[-1]
        params = self.sampling_params
        if (not params.ignore_eos and last in self.eos_token_ids) or last in params.stop_token_ids:
            self.finished_reason = FinishReason("stop", matched=last)
        elif len(self.output_ids) >= params.max_new_tokens or self.seq_len >= context_len:
            self.finished_reason = FinishReason("length")

    def abort(self, message: str) -> None:
        if self.finished_reason is None:
            self.finished_reason = FinishReason("abort", message=message)
