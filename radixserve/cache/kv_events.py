"""KV cache events: what the radix cache stored and removed, in vLLM's KVEventBatch encoding.

The structs encode as msgpack arrays, each event tagged with its class name first (msgspec's
array_like + tag), exactly as vLLM's `vllm.distributed.kv_events` and SGLang's copy of it do, so
their subscribers and KV-aware routers decode them unchanged:

    KVEventBatch = [ts, [event, ...], data_parallel_rank]
    BlockStored = ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
    BlockRemoved = ["BlockRemoved", block_hashes, medium]
    AllBlocksCleared = ["AllBlocksCleared"]

A block is one page of the tree (--page-size tokens), named by its hash (cache/block_hash.py). The
cache records events as they happen (KVEventRecorder); the scheduler takes them once per step and
publishes them as one batch (scheduler/kv_events.py).
"""

from __future__ import annotations

import time
from typing import Any

import msgspec


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """A change to the set of cached blocks."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class KVEventRecorder:
    """Collects the radix cache's events until the scheduler takes them.

    medium: where the blocks live, vLLM's word for the device tier ("GPU" on CUDA, "CPU" here on a
    CPU)."""

    def __init__(self, page_size: int, medium: str) -> None:
        self.page_size = page_size
        self.medium = medium
        self._pending: list[BlockStored | BlockRemoved | AllBlocksCleared] = []

    def stored(self, hashes: list[int], parent_hash: int | None, tokens: list[int]) -> None:
        self._pending.append(BlockStored(hashes, parent_hash, tokens, self.page_size, None, self.medium))

    def removed(self, hashes: list[int]) -> None:
        self._pending.append(BlockRemoved(hashes, self.medium))

    def cleared(self) -> None:
        # Whatever was pending is moot: the subscriber forgets every block anyway.
        self._pending = [AllBlocksCleared()]

    def take(self, data_parallel_rank: int | None = None) -> KVEventBatch | None:
        """The events since the last take, as one batch (None when there were none)."""
        if not self._pending:
            return None
        events, self._pending = self._pending, []
        return KVEventBatch(ts=time.time(), events=events, data_parallel_rank=data_parallel_rank)
