"""StorageTier: the hierarchical cache's storage level, K/V pages on disk (cache/storage.py).

What it keeps: pages of `block_size` tokens (a multiple of the device page), each named by the hash
chain of its tokens from the start of the text (cache/block_hash.py), so the same prefix finds the
same pages in any process serving the same model: after a restart, or from another replica sharing
the directory.

When it writes (--hicache-write-policy, SGLang's names):
- write_through (the default): every page that enters the device tree, as it is inserted;
- write_back: a node's pages when it is evicted from the device pool;
- write_through_selective: a page once a request's prompt hit it on the device (so it was used
  twice), not on insertion nor on eviction.
The K/V are gathered out of the pool on the scheduler's thread, ordered before the forward that
may reuse their slots; their copy to host memory runs beside the forwards (on a CUDA device, a
stream of its own: cache/kv_copy.py) and the tier's I/O thread waits for it, then writes. At most
`max_queued_writes` pages wait; past that a write is dropped and counted (the prefix is then
recomputed if needed, never wrong).

How it loads: a waiting request's prompt is looked up by `prefetch` (hashes and an in-memory
index, no disk access) when the scheduler first considers it. If the levels hold pages past what
the device tree matched, and all of them are in host memory (L2), they are read there and then
and the request is admitted in the same step, as SGLang loads host hits back when it schedules.
Otherwise the I/O thread reads them while the request stays in the queue and the batch goes on
without it; `install`, on the scheduler's thread before each prefill batch is
chosen, puts them into the device pool and the tree (beside a CUDA pool, the I/O thread has
already started their copy to the device; installing only orders it before the next forward), and
the request is admitted with them as its cached prefix. A page that fails to read (removed,
truncated, another model's) ends the load there.

Tensor parallelism: every rank keeps its own heads' pages (its own fingerprint) and runs this tier
alike, and the ranks' schedulers must admit the same requests with the same cached prefixes. What
a rank's disk holds, and when its loads finish, are its own, so both are agreed (`least`, the
smallest over the ranks): a lookup loads only the pages every rank holds, and a load is installed,
in the order the lookups were made, once every rank has finished it, as far as every rank read it.

Threads: the scheduler's thread calls every method here; the I/O thread alone calls the backend's
put, get and clear. `in` on the backend's index from the scheduler's thread is a single dict lookup
(atomic under the GIL) and at worst stale: a page it thinks stored is checked again on load.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from radixserve.cache.block_hash import page_hashes
from radixserve.cache.host_storage import HostKVStorage
from radixserve.cache.kv_copy import KVCopy
from radixserve.cache.pools import KVSlotAllocator
from radixserve.cache.storage import FileKVStorage, PageOrigin, StorageFingerprint
from radixserve.cache.tiers import CacheTier, PrefixTree, TierLoad

logger = logging.getLogger(__name__)

WRITE_POLICIES = ("write_through", "write_back", "write_through_selective")
# Job priorities: loads first (a request waits on them), then clears and writes, then drain's
# marker (everything queued before it has run), then the stop.
_LOAD, _CLEAR, _WRITE, _MARK, _STOP = 0, 1, 2, 3, 4


class PageStore(Protocol):
    """A level that keeps pages (cache/storage.py's files, cache/host_storage.py's host memory)."""

    fingerprint: StorageFingerprint
    enabled: bool

    def __contains__(self, page_hash: int) -> bool: ...

    def put(self, page_hash: int, kv: torch.Tensor, origin: PageOrigin) -> bool: ...

    def get(self, page_hash: int) -> torch.Tensor | None: ...

    def clear(self) -> None: ...

    def disable(self, why: str) -> None: ...

    def check(self) -> list[str]: ...

    def level_stats(self) -> dict[str, Any]: ...


class KVAccess(Protocol):
    """The device pool's K/V, as the executor offers them (executor/base.py, KVSlots)."""

    def read_kv(self, slots: torch.Tensor) -> torch.Tensor:
        """Every layer's K and V at slots, copied: [num_layers, 2, len(slots), kv_heads, head_dim]."""
        ...

    def write_kv(self, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """The inverse of read_kv: kv into slots (a lower cache tier loads a prefix back)."""
        ...

    def read_kv_async(self, slots: torch.Tensor) -> KVCopy:
        """read_kv's K/V as a copy under way (cache/kv_copy.py): the gather is ordered before the
        next forward, the copy to host memory is not waited for here."""
        ...

    def upload_kv(self, pages: list[torch.Tensor]) -> KVCopy:
        """Host pages (read_kv's shape) joined along the tokens, copied to where write_kv reads
        fastest; started on any thread, waited for on the scheduler's."""
        ...


@dataclass
class _Load:
    tokens: list[int]  # the prompt up to the end of the last page to load
    first_block: int
    hashes: list[int]  # of blocks first_block, first_block + 1, ...
    ticket: TierLoad
    pages: list[torch.Tensor] = field(default_factory=list)
    uploaded: KVCopy | None = None  # the pages on their way to the device pool, once all are read
    finished: bool = False  # the I/O thread is done with it (set under the tier's lock)


def each_alone(values: list[int]) -> list[int]:
    """One rank: its own values are everyone's."""
    return values


@dataclass
class StorageTierStats:
    """Counters since startup (get_server_info, /metrics)."""

    lookups: int = 0
    hit_tokens: int = 0  # tokens the tier put back into the device tree
    loads: int = 0
    load_failures: int = 0  # loads that found a page missing or bad partway
    pages_written: int = 0
    writes_dropped: int = 0  # the write queue was full
    bytes_read: int = 0
    pages_from_host: int = 0  # of the pages loaded, those L2 had (the rest came from disk)
    bytes_written: int = 0
    load_seconds: float = 0.0
    write_seconds: float = 0.0


class StorageTier(CacheTier):
    name = "storage"

    def __init__(
        self,
        storage: FileKVStorage | None,
        kv: KVAccess,
        allocator: KVSlotAllocator,
        write_policy: str = "write_through",
        max_queued_writes: int = 4096,
        least: Callable[[list[int]], list[int]] = each_alone,
        host: HostKVStorage | None = None,
    ) -> None:
        """storage: the file backend; host: L2, host memory beside a CUDA device pool; at least
        one. least: each value's smallest over the tensor-parallel ranks (scheduler/rank_sync.py)."""
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"--hicache-write-policy must be one of {', '.join(WRITE_POLICIES)}")
        self.storage = storage
        self.host = host
        # Fastest first: a page is written to every level and read from the first that has it.
        self.levels: list[PageStore] = [level for level in (host, storage) if level is not None]
        if not self.levels:
            raise ValueError("a storage tier needs a host pool or a storage backend")
        self.name = "storage" if storage is not None else "host"
        self.kv = kv
        self.allocator = allocator
        self.block_size = self.levels[0].fingerprint.page_size
        if self.block_size % allocator.page_size:
            raise ValueError("the storage page must be a whole number of device pages")
        self.write_policy = write_policy
        self.max_queued_writes = max_queued_writes
        self.counters = StorageTierStats()
        self._jobs: queue.PriorityQueue[tuple[int, int, Any]] = queue.PriorityQueue()
        self._order = itertools.count()
        self._lock = threading.Lock()  # guards the fields below
        self._queued_writes: set[int] = set()
        self.least = least
        # Loads not installed yet, in the order they were asked for (the scheduler's thread alone).
        self._pending: list[_Load] = []
        self._load_finished = threading.Event()
        self._thread = threading.Thread(target=self._work, name="radixserve-hicache-io", daemon=True)
        self._thread.start()

    # ---- the radix cache's hooks (scheduler thread) -----------------------------------------

    def on_insert(self, tokens: Sequence[int], slots: torch.Tensor, new_from: int) -> None:
        if self.write_policy == "write_through":
            self._write(tokens, slots, new_from // self.block_size, len(tokens) // self.block_size)

    def on_evict(self, tokens: Sequence[int], slots: torch.Tensor, own_from: int) -> None:
        # write_through wrote these on insertion, unless its queue was full then: written now.
        if self.write_policy != "write_through_selective":
            self._write(tokens, slots, own_from // self.block_size, len(tokens) // self.block_size)

    def prefetch(self, tokens: Sequence[int], matched: torch.Tensor) -> TierLoad | None:
        # Everything before the ranks agree below depends only on what every rank's scheduler
        # sees alike (the prompt, the device tree), so all ranks reach it together.
        size, on_device = self.block_size, int(matched.shape[0])
        blocks = len(tokens) // size
        if self._enabled():
            self.counters.lookups += 1
            if self.write_policy == "write_through_selective":
                self._write(tokens, matched, 0, on_device // size)
        first = on_device // size
        if first >= blocks:
            return None
        hashes = page_hashes(None, list(tokens[: blocks * size]), size)
        last = first
        while last < blocks and self._holds(hashes[last]):
            last += 1
        in_host = first
        while in_host < last and self.host is not None and hashes[in_host] in self.host:
            in_host += 1
        last, in_host = self.least([last, in_host])
        if last * size <= on_device:
            return None
        ticket = TierLoad()
        load = _Load(list(tokens[: last * size]), first, hashes[first:last], ticket)
        ticket.detail = load
        self._pending.append(load)
        if in_host >= last:
            # All of it in host memory: read here and now (a dict lookup and a copy per page; the
            # copy to the device runs on the copier's stream), so the next `install` puts it into
            # the tree and the request is admitted in this very step. A round trip through the
            # I/O thread would keep it waiting a step for nothing. Disk reads stay off this thread.
            self._load(load)
        else:
            self._jobs.put((_LOAD, next(self._order), load))
        return ticket

    def install(self, cache: PrefixTree) -> None:
        if not self._pending:
            return
        with self._lock:
            # -1: not finished on this rank yet; else how many of its pages this rank read.
            local = [len(load.pages) if load.finished else -1 for load in self._pending]
        agreed = self.least(local)
        waiting = []
        for load, pages in zip(self._pending, agreed, strict=True):
            if pages < 0:
                waiting.append(load)
                continue
            del load.pages[pages:]  # as far as every rank read it
            load.ticket.tokens = self._install_one(cache, load)
            load.ticket.done = True
            self.counters.hit_tokens += load.ticket.tokens
        self._pending = waiting

    def _install_one(self, cache: PrefixTree, load: _Load) -> int:
        """The loaded pages into the pool and the tree past what the device matches now (which may
        have changed since the lookup); the tokens added."""
        size = self.block_size
        end = (load.first_block + len(load.pages)) * size
        if end <= load.first_block * size:
            return 0
        match = cache.match_prefix(load.tokens[:end])
        on_device = len(match)
        if on_device >= end or on_device < load.first_block * size:
            return 0  # it arrived meanwhile, or the prefix it continues was evicted
        need = end - on_device
        cache.inc_lock_ref(match.last_node)  # making room must not evict the prefix it continues
        try:
            shortfall = need - self.allocator.available_size()
            if shortfall > 0:
                cache.evict(shortfall)
            last_loc = int(match.kv_indices[-1]) if on_device else -1
            slots = self.allocator.alloc_extend([on_device], [last_loc], [need])
            if slots is None:
                return 0
            assert load.uploaded is not None  # a finished load with pages has started their copy
            start = load.first_block * size
            kv = load.uploaded.wait()[:, :, on_device - start : end - start]
            self.kv.write_kv(slots, kv)
            present = cache.insert(load.tokens[:end], torch.cat([match.kv_indices, slots]))
            assert present == on_device, "the tree changed between a match and an insert"
        finally:
            cache.dec_lock_ref(match.last_node)
        return need

    # ---- the rest of the tier's interface ----------------------------------------------------

    def clear(self) -> None:
        self._jobs.put((_CLEAR, next(self._order), None))

    @property
    def loading(self) -> bool:
        return bool(self._pending)

    def wait_for_loads(self, timeout_s: float) -> None:
        if self._load_finished.wait(timeout_s):
            self._load_finished.clear()

    def weights_changed(self) -> None:
        for level in self.levels:
            level.disable("the model's weights changed, so the stored K/V no longer match them")

    def drain(self, timeout_s: float = 30.0) -> None:
        """Waits until every queued job has run (tests, shutdown)."""
        done = threading.Event()
        self._jobs.put((_MARK, next(self._order), done))
        done.wait(timeout_s)

    def check_invariant(self) -> list[str]:
        return [problem for level in self.levels for problem in level.check()]

    def stats(self) -> dict[str, Any]:
        c = self.counters
        with self._lock:
            queued = len(self._queued_writes)
        in_flight = sum(not load.finished for load in self._pending)
        levels: dict[str, Any] = {}
        for level in self.levels:
            levels |= level.level_stats()
        if self.host is not None:
            levels["hicache_host_pages_loaded"] = c.pages_from_host
        return {
            **levels,
            "hicache_write_policy": self.write_policy,
            "hicache_storage_page_tokens": self.block_size,
            "hicache_storage_lookups": c.lookups,
            "hicache_storage_hit_tokens": c.hit_tokens,
            "hicache_storage_loads": c.loads,
            "hicache_storage_load_failures": c.load_failures,
            "hicache_storage_pages_written": c.pages_written,
            "hicache_storage_writes_dropped": c.writes_dropped,
            "hicache_storage_bytes_read": c.bytes_read,
            "hicache_storage_bytes_written": c.bytes_written,
            "hicache_storage_load_seconds": c.load_seconds,
            "hicache_storage_write_seconds": c.write_seconds,
            "hicache_storage_queued_writes": queued,
            "hicache_storage_loads_in_flight": in_flight,
        }

    def close(self) -> None:
        self._jobs.put((_STOP, next(self._order), None))
        self._thread.join(timeout=30)

    # ---- writing (scheduler thread: the copy; I/O thread: the file) --------------------------

    def _write(self, tokens: Sequence[int], slots: torch.Tensor, first: int, last: int) -> None:
        """Queues blocks [first, last) of tokens (at slots) that are not stored or queued yet."""
        if first >= last or not self._enabled():
            return
        size = self.block_size
        hashes = page_hashes(None, list(tokens[: last * size]), size)
        wanted = []
        with self._lock:
            for block in range(first, last):
                page_hash = hashes[block]
                if self._holds(page_hash) or page_hash in self._queued_writes:
                    continue
                if len(self._queued_writes) >= self.max_queued_writes:
                    self.counters.writes_dropped += last - block
                    break
                self._queued_writes.add(page_hash)
                wanted.append(block)
        if not wanted:
            return
        index = torch.cat([torch.arange(b * size, (b + 1) * size) for b in wanted])
        copy = self.kv.read_kv_async(slots[index])  # one copy for every page; each job a part of it
        for i, block in enumerate(wanted):
            origin = PageOrigin(
                hashes[block - 1] if block else None, tokens[block * size : (block + 1) * size]
            )
            self._jobs.put((_WRITE, next(self._order), (hashes[block], copy, i * size, origin)))

    # ---- the levels --------------------------------------------------------------------------

    def _enabled(self) -> bool:
        return any(level.enabled for level in self.levels)

    def _holds(self, page_hash: int) -> bool:
        return any(page_hash in level for level in self.levels)

    def _read(self, page_hash: int) -> tuple[torch.Tensor | None, PageStore | None]:
        """The page from the fastest level that has it, and that level."""
        for level in self.levels:
            page = level.get(page_hash)
            if page is not None:
                return page, level
        return None, None

    # ---- the I/O thread ----------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            kind, _, job = self._jobs.get()
            try:
                if kind == _STOP:
                    return
                if kind == _LOAD:
                    self._load(job)
                elif kind == _WRITE:
                    self._store(*job)
                elif kind == _CLEAR:
                    for level in self.levels:
                        level.clear()
                else:
                    job.set()  # drain's marker
            except Exception:  # a bug here must not take the scheduler down: log, and go on
                logger.exception("storage tier: an I/O job failed")
                if kind == _LOAD:
                    self._finish(job)

    def _load(self, load: _Load) -> None:
        """Reads the load's pages (on the I/O thread, or on the scheduler's for host memory alone)
        and starts their copy to the device."""
        started = time.perf_counter()
        failed, from_host, read = 0, 0, 0
        for page_hash in load.hashes:
            page, level = self._read(page_hash)
            if page is None:
                failed = 1
                break
            load.pages.append(page)
            from_host += level is self.host
            read += page.numel() * page.element_size()
        if load.pages:
            load.uploaded = self.kv.upload_kv(load.pages)
        with self._lock:  # both threads load
            c = self.counters
            c.loads += 1
            c.load_failures += failed
            c.pages_from_host += from_host
            c.bytes_read += read
            c.load_seconds += time.perf_counter() - started
        self._finish(load)

    def _finish(self, load: _Load) -> None:
        with self._lock:
            load.finished = True
        self._load_finished.set()

    def _store(self, page_hash: int, copy: KVCopy, start: int, origin: PageOrigin) -> None:
        started = time.perf_counter()
        page = copy.wait()[:, :, start : start + self.block_size].contiguous()
        # Every level, each on its own budget (a list, not any(): no level is skipped).
        stored = any([level.put(page_hash, page, origin) for level in self.levels])
        with self._lock:
            self._queued_writes.discard(page_hash)
        if stored:
            self.counters.pages_written += 1
            self.counters.bytes_written += page.numel() * page.element_size()
        self.counters.write_seconds += time.perf_counter() - started
