"""L2 of the hierarchical cache: K/V pages in host memory, beside a CUDA device pool.

SGLang's HiCache keeps evicted prefixes in a host-memory pool a few times the size of the GPU's
KV pool, where reading them back is a copy over PCIe instead of a recompute. HostKVStorage is that
level as a page store, with the same interface as the file backend (cache/storage.py): pages of
the storage page size, named by the hash chain of their tokens, least recently used first out of
a byte budget (--hicache-size GB, else --hicache-ratio times the device pool). The storage tier
(cache/storage_tier.py) writes each page here and to the file backend when there is one, and loads
a page from here before it looks on disk; both on its I/O thread.

On a CPU the device pool is host memory already, so there is no L2 unless
RADIXSERVE_HICACHE_HOST_POOL=1 forces one (for the tests, and to run this path without a GPU).

Pages live in chunks of memory allocated a few pages at a time and reused once dropped
(`_PageSlab`): pinning host memory is slow and serializes with the CUDA calls of the forward's
thread, so L2 pins a chunk now and then instead of every page it keeps.

Events: with a recorder (medium "CPU" beside a GPU; "HOST" when forced on a CPU, whose device pool
is "CPU"), every page stored here or dropped from here is recorded, as the file backend does.
"""

from __future__ import annotations

import logging
import threading
from array import array
from collections import OrderedDict, deque
from typing import Any

import torch

from radixserve.cache.kv_copy import copies_issued
from radixserve.cache.kv_events import KVEventRecorder
from radixserve.cache.storage import PageOrigin, StorageFingerprint, accounting_problems

logger = logging.getLogger(__name__)

# Forces an L2 host pool beside a CPU device pool (which is host memory itself).
FORCE_HOST_POOL_ENV = "RADIXSERVE_HICACHE_HOST_POOL"


# Memory allocated at once for pages (bytes, at least one page): few enough pinnings, little unused.
SLAB_CHUNK_BYTES = 64 << 20


class _PageSlab:
    """Pages of one layout carved out of chunks of (pinned) host memory; a dropped page is reused
    for a page put later. Beside a CUDA pool, a dropped page may still be the source of an upload
    in flight on the copy stream, so it is reused only once the copies issued before its drop are
    done (kv_copy.copies_issued). Thread-safe: pages are put on the I/O thread and dropped on
    either thread; pinning and waiting happen outside the lock."""

    def __init__(
        self, layout: StorageFingerprint, pinned_for: torch.device | None, chunk_bytes: int = SLAB_CHUNK_BYTES
    ) -> None:
        self.layout = layout
        self.pinned_for = pinned_for
        self.chunk_bytes = chunk_bytes
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []
        self._dropped: deque[tuple[torch.Tensor, torch.cuda.Event | None]] = deque()
        self.pages = 0  # allocated, in use or not

    def take(self, max_pages: int) -> torch.Tensor:
        """A page to write; chunks are allocated up to max_pages pages in all."""
        with self._lock:
            if self._free:
                return self._free.pop()
            oldest = self._dropped.popleft() if self._dropped else None
        if oldest is not None:
            page, copied = oldest
            if copied is not None:
                copied.synchronize()  # usually long done: the page was least recently used
            return page
        layout = self.layout
        per_chunk = max(1, min(max_pages - self.pages, self.chunk_bytes // max(1, layout.kv_bytes)))
        pinned = self.pinned_for is not None
        chunk = torch.empty((per_chunk, *layout.page_shape), dtype=layout.dtype, pin_memory=pinned)
        page, *rest = chunk.unbind(0)
        with self._lock:
            self.pages += per_chunk
            self._free.extend(rest)
        return page

    def drop(self, page: torch.Tensor) -> None:
        copied = copies_issued(self.pinned_for) if self.pinned_for is not None else None
        with self._lock:
            if copied is None:
                self._free.append(page)
            else:
                self._dropped.append((page, copied))

    def release(self) -> None:
        """Every chunk given back to the allocator (no page may be in use)."""
        with self._lock:
            self._free.clear()
            self._dropped.clear()
            self.pages = 0


class HostKVStorage:
    def __init__(
        self,
        fingerprint: StorageFingerprint,
        budget_bytes: int,
        events: KVEventRecorder | None = None,
        pinned_for: torch.device | None = None,
    ) -> None:
        """pinned_for: the CUDA device whose pool this level backs; its pages are then page-locked
        (their copies to and from the device are asynchronous, cache/kv_copy.py)."""
        self.fingerprint = fingerprint
        self.pinned = pinned_for is not None
        self._slab = _PageSlab(fingerprint, pinned_for)
        self.budget_bytes = budget_bytes
        self.events = events
        # Guards the pages against announce (scheduler thread) while the I/O thread changes them;
        # with events, the recorder's lock, so a change and its event are one step for a clear.
        self._lock = events.lock if events is not None else threading.RLock()
        self.enabled = True
        # page hash -> (K/V, what it holds), least recently used first.
        self._pages: OrderedDict[int, tuple[torch.Tensor, PageOrigin]] = OrderedDict()
        self.used_bytes = 0
        if events is not None:
            events.after_clear(self.announce)

    @property
    def page_bytes(self) -> int:
        return self.fingerprint.kv_bytes

    def __contains__(self, page_hash: int) -> bool:
        return self.enabled and page_hash in self._pages

    def __len__(self) -> int:
        return len(self._pages)

    def put(self, page_hash: int, kv: torch.Tensor, origin: PageOrigin) -> bool:
        """Keeps one page's K/V (a copy of its own: the caller's tensor may be a view of a larger
        one); False when L2 is off or the page cannot fit the budget. A page already here is only
        marked used."""
        if not self.enabled:
            return False
        with self._lock:
            if page_hash in self._pages:
                self._pages.move_to_end(page_hash)
                return True
        self.fingerprint.check_page(kv, origin.tokens)
        size = self.page_bytes
        if size > self.budget_bytes:
            return False
        page = self._slab.take(self.budget_bytes // size + 1)
        page.copy_(kv.detach())
        with self._lock:
            if page_hash in self._pages:  # put meanwhile on another thread
                self._slab.drop(page)
                self._pages.move_to_end(page_hash)
                return True
            while self.used_bytes + size > self.budget_bytes:
                self._remove(next(iter(self._pages)))
            self._pages[page_hash] = (page, PageOrigin(origin.parent_hash, array("q", origin.tokens)))
            self.used_bytes += size
            if self.events is not None:
                self.events.stored([page_hash], origin.parent_hash, list(origin.tokens))
        return True

    def get(self, page_hash: int) -> torch.Tensor | None:
        """The page's K/V as they were put (not to be written to), or None when it is not here."""
        with self._lock:
            if not self.enabled or page_hash not in self._pages:
                return None
            self._pages.move_to_end(page_hash)
            return self._pages[page_hash][0]

    def clear(self) -> None:
        with self._lock:
            removed = list(self._pages)
            for page, _ in self._pages.values():
                self._slab.drop(page)
            self._pages.clear()
            self.used_bytes = 0
            if removed and self.events is not None:
                self.events.removed(removed)

    def announce(self) -> None:
        """Records every page held as stored (after the device tree's AllBlocksCleared, which made
        subscribers forget them)."""
        if self.events is None or not self.enabled:
            return
        with self._lock:
            for page_hash, (_, origin) in self._pages.items():
                self.events.stored([page_hash], origin.parent_hash, list(origin.tokens))

    def disable(self, why: str) -> None:
        """Off for the rest of this process, its memory given back, with one log line."""
        if not self.enabled:
            return
        logger.warning("host KV pool (L2) off: %s", why)
        self.clear()
        self.enabled = False
        self._slab.release()

    def level_stats(self) -> dict[str, Any]:
        return {
            "hicache_host_enabled": self.enabled,
            "hicache_host_pages": len(self),
            "hicache_host_bytes": self.used_bytes,
            "hicache_host_budget_bytes": self.budget_bytes,
        }

    def check(self) -> list[str]:
        """Problems with this level's accounting (checked with the KV invariant when idle)."""
        return accounting_problems(
            "host pool", self.used_bytes, self.budget_bytes, len(self), self.page_bytes
        )

    def _remove(self, page_hash: int) -> None:
        """Drops the page (under the lock)."""
        self._slab.drop(self._pages.pop(page_hash)[0])
        self.used_bytes -= self.page_bytes
        if self.events is not None:
            self.events.removed([page_hash])
