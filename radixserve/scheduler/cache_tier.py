"""The cache tier below the device pool that the flags ask for (config/hicache_args.py): the
device pool alone, or the storage tier (cache/storage_tier.py) over an L2 host-memory pool (beside
a CUDA device pool; cache/host_storage.py), a directory of page files, or both."""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from radixserve.cache.host_storage import FORCE_HOST_POOL_ENV, HostKVStorage
from radixserve.cache.kv_copy import KVCopy
from radixserve.cache.kv_events import KVEventRecorder
from radixserve.cache.pools import KVSlotAllocator
from radixserve.cache.storage import FileKVStorage, StorageFingerprint
from radixserve.cache.storage_tier import StorageTier
from radixserve.cache.tiers import CacheTier, DeviceOnlyTier
from radixserve.config.hicache_args import storage_dir
from radixserve.config.server_args import ServerArgs
from radixserve.executor.base import Executor, KVSlots, MissingCapabilityError
from radixserve.scheduler.rank_sync import RankSync

logger = logging.getLogger("radixserve.scheduler")

# Weight files whose names, sizes and modification times name the model's weights.
_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt")


def model_identity(model_path: str | None, config_text: str) -> str:
    """What a stored page's model must equal: the model's resolved path, its config, and the
    names, sizes and modification times of its weight files (so re-saved weights, even under the
    same path and config, never read another's pages)."""
    digest = hashlib.blake2b(config_text.encode(), digest_size=8)
    if model_path:
        path = Path(model_path).expanduser().resolve()
        digest.update(str(path).encode())
        files = sorted(path.glob("*")) if path.is_dir() else [path]
        for file in files:
            if file.suffix in _WEIGHT_SUFFIXES and file.is_file():
                stat = file.stat()
                digest.update(f"{file.name}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    return digest.hexdigest()


# KV cache events' media below the device pool (whose own is "GPU" or "CPU"): the storage tier's
# pages, and L2's host memory (beside a GPU; "HOST" when forced beside a CPU device pool).
STORAGE_MEDIUM = "DISK"
HOST_MEDIUM = "CPU"
FORCED_HOST_MEDIUM = "HOST"


@dataclass(frozen=True)
class NotifyingKVAccess:
    """The executor's K/V as a tier reads and writes them, telling `written` of every slot a
    tier's load wrote (a STANDALONE draft model then knows its own K/V there is stale)."""

    executor: KVSlots
    written: Callable[[torch.Tensor], None]

    def read_kv(self, slots: torch.Tensor) -> torch.Tensor:
        return self.executor.read_kv(slots)

    def write_kv(self, slots: torch.Tensor, kv: torch.Tensor) -> None:
        self.executor.write_kv(slots, kv)
        self.written(slots)

    def read_kv_async(self, slots: torch.Tensor) -> KVCopy:
        return self.executor.read_kv_async(slots)

    def upload_kv(self, pages: list[torch.Tensor]) -> KVCopy:
        return self.executor.upload_kv(pages)


def build_cache_tier(
    args: ServerArgs,
    executor: Executor,
    allocator: KVSlotAllocator,
    events: KVEventRecorder | None = None,
    written: Callable[[torch.Tensor], None] | None = None,
    rank_sync: RankSync | None = None,
) -> CacheTier:
    """events: the device tree's KV event recorder, when events are published; the storage tier
    then records its own pages' events into the same stream. written: told of the slots a load
    writes K/V to, past the executor. rank_sync: the scheduler's; with tensor parallelism each rank
    stores its own heads' pages under a fingerprint of its own, and the ranks agree on what they
    load (cache/storage_tier.py)."""
    if not args.enable_hierarchical_cache:
        return DeviceOnlyTier()
    device = executor.info.device
    with_host = device.type == "cuda" or os.environ.get(FORCE_HOST_POOL_ENV) == "1"
    if not with_host:
        logger.info(
            "hierarchical cache: the device pool is host memory here, so there is no separate L2 "
            "(--hicache-ratio / --hicache-size unused)"
        )
    if args.hicache_storage_backend is None and not with_host:
        logger.info("hierarchical cache: no --hicache-storage-backend, so the device pool is the only tier")
        return DeviceOnlyTier()
    if not isinstance(executor, KVSlots):
        raise MissingCapabilityError(executor, KVSlots, "--enable-hierarchical-cache")
    layout = executor.kv_layout()
    assert args.hicache_storage_page_size is not None  # set by ServerArgs.validate
    identity = model_identity(args.model_path, repr(executor.info.config))
    rank_sync = rank_sync or RankSync()
    parallel = rank_sync.parallel
    if parallel.tp_size > 1:
        identity += f"|tp{parallel.tp_rank}/{parallel.tp_size}"
    fingerprint = StorageFingerprint(
        identity,
        layout.dtype,
        args.hicache_storage_page_size,
        layout.num_layers,
        layout.num_kv_heads,
        layout.head_dim,
    )
    page_size = fingerprint.page_size
    host = None
    if with_host:
        token_bytes = fingerprint.kv_bytes // page_size
        budget = (
            int(args.hicache_size * (1 << 30))
            if args.hicache_size > 0
            else int(args.hicache_ratio * executor.info.max_total_tokens * token_bytes)
        )
        medium = HOST_MEDIUM if device.type == "cuda" else FORCED_HOST_MEDIUM
        host = HostKVStorage(
            fingerprint,
            budget,
            events.for_medium(page_size, medium) if events is not None else None,
            pinned_for=device if device.type == "cuda" else None,
        )
        logger.info(
            "hierarchical cache: L2 host pool of %.2f GB (%d pages of %d tokens)",
            budget / (1 << 30),
            budget // max(1, host.page_bytes),
            page_size,
        )
    storage = None
    if args.hicache_storage_backend is not None:
        storage = FileKVStorage(
            storage_dir(args),
            fingerprint,
            int(args.hicache_storage_size_gb * (1 << 30)),
            events.for_medium(page_size, STORAGE_MEDIUM) if events is not None else None,
        )
        logger.info(
            "hierarchical cache: storage tier in %s (%d pages of %d tokens found, %s)",
            storage.directory,
            len(storage),
            page_size,
            args.hicache_write_policy,
        )
    kv = executor if written is None else NotifyingKVAccess(executor, written)
    return StorageTier(storage, kv, allocator, args.hicache_write_policy, least=rank_sync.least, host=host)
