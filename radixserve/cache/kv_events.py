"""KV cache events: what the radix cache stored and removed, in vLLM's KVEventBatch encoding.

The structs encode as msgpack arrays, each event tagged with its class name first (msgspec's
array_like + tag), exactly as vLLM's `vllm.distributed.kv_events` and SGLang's copy of it do, so
their subscribers and KV-aware routers decode them unchanged:

    KVEventBatch = [ts, [event, ...], data_parallel_rank]
    BlockStored = ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
    BlockRemoved = ["BlockRemoved", block_hashes, medium]
    AllBlocksCleared = ["AllBlocksCleared"]

A block is one page of the tree (--page-size tokens), named by its hash (cache/block_hash.py), or
one page of the storage tier (--hicache-storage-page-size tokens, medium "DISK"). The caches record
events as they happen (KVEventRecorder); the scheduler takes them once per step and publishes them
as one batch (scheduler/kv_events.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec

from radixserve.cache.key_space import split_namespace


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


class _EventLog:
    """The events of every medium in the order they happened, and who re-announces what a clear
    makes subscribers forget. One lock for all: the storage tier records from its I/O thread."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.pending: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
        self.after_clear: list[Callable[[], None]] = []


class KVEventRecorder:
    """Collects a cache's events until the scheduler takes them.

    medium: where the blocks live, vLLM's word for the device tier ("GPU" on CUDA, "CPU" here on a
    CPU); the storage tier records as "DISK" through `for_medium`, into the same log."""

    def __init__(self, page_size: int, medium: str, log: _EventLog | None = None) -> None:
        self.page_size = page_size
        self.medium = medium
        self._log = log or _EventLog()

    def for_medium(self, page_size: int, medium: str) -> KVEventRecorder:
        """A recorder for another tier's blocks, into this one's log (so one batch holds both, in
        the order they happened)."""
        return KVEventRecorder(page_size, medium, self._log)

    @property
    def lock(self) -> threading.RLock:
        """Held while recording; a tier holds it across a change to its blocks and the change's
        event, so that a clear and its re-announcement (after_clear) never fall in between."""
        return self._log.lock

    def after_clear(self, announce: Callable[[], None]) -> None:
        """`announce` runs inside every clear, under the lock: AllBlocksCleared tells subscribers
        to forget every block of every medium, so a tier the clear did not empty says again what
        it holds."""
        self._log.after_clear.append(announce)

    def stored(self, hashes: list[int], parent_hash: int | None, tokens: list[int]) -> None:
        # Keys in a LoRA adapter's namespace go out as its lora_id and the plain token ids.
        namespace, token_ids = split_namespace(tokens)
        event = BlockStored(hashes, parent_hash, token_ids, self.page_size, namespace or None, self.medium)
        with self._log.lock:
            self._log.pending.append(event)

    def removed(self, hashes: list[int]) -> None:
        with self._log.lock:
            self._log.pending.append(BlockRemoved(hashes, self.medium))

    def cleared(self) -> None:
        with self._log.lock:
            # Whatever was pending is moot: the subscriber forgets every block anyway.
            self._log.pending = [AllBlocksCleared()]
            for announce in self._log.after_clear:
                announce()

    @property
    def pending(self) -> bool:
        """Events wait to be taken (the storage tier's I/O thread records while the scheduler
        idles)."""
        with self._log.lock:
            return bool(self._log.pending)

    def take(self, data_parallel_rank: int | None = None) -> KVEventBatch | None:
        """The events since the last take, as one batch (None when there were none)."""
        with self._log.lock:
            if not self._log.pending:
                return None
            events, self._log.pending = self._log.pending, []
        return KVEventBatch(ts=time.time(), events=events, data_parallel_rank=data_parallel_rank)
