"""The storage tier's file backend: K/V pages on disk, one file per page, named by its hash.

A page's hash (cache/block_hash.py) names its whole token prefix, so any process serving the same
model with the same KV layout finds the pages another wrote: across restarts, and across replicas
sharing a directory. What "the same" means is the fingerprint (StorageFingerprint): the model's
identity, the KV dtype, the page size, the pool's shape and this format's version. It names the
directory the pages live in and is written into every file's header, so a page written by
another model, dtype, page size or version is never found, and a file whose header disagrees
(moved, truncated, corrupted) is refused and removed, never loaded.

File layout: <root>/<fingerprint>/<2 hex digits>/<16 hex digits>.kv, holding a fixed header
(magic, version, fingerprint, page hash, parent page hash or -1, payload bytes and CRC-32), the page's token
ids (page_size int64s), and the payload: the page's K and V for every layer, [num_layers, 2,
page_size, kv_heads, head_dim] in the pool's dtype, as raw bytes. The token ids and the parent let
a process that finds the page announce it as a KV cache event (BlockStored wants both) and check
that the page's name is the hash of what it says it holds.

Budget: the files together stay within `budget_bytes`; storing past it removes the least recently
used pages first (a load counts as a use and touches the file's mtime, so the order survives a
restart). Faults: an OSError while writing (a full disk, a read-only mount, no permission) turns
the tier off with one log line; the server goes on without it and no client sees an error.

Events: with a recorder (cache/kv_events.py, medium "DISK"), every page stored or removed is
recorded as it happens, and `announce` records every page held (after a restart, and after the
device tree's AllBlocksCleared, which tells subscribers to forget the disk's blocks too).

This module is only the backend (synchronous, one caller at a time); the hierarchical tier that
writes evicted pages and loads them on a match, off the scheduler's thread, builds on it.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import struct
import threading
import zlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from radixserve.cache.block_hash import page_hash as chain_hash
from radixserve.cache.kv_events import KVEventRecorder

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2
_MAGIC = b"RSKV"
# magic, version, fingerprint (16 hex digits as bytes), page hash, parent hash (-1: none), payload
# bytes, the payload's CRC-32 (a flipped bit in the K/V is caught on load, not served)
_HEADER = struct.Struct("<4sI16sQqQI")
_TOKEN = array("q").itemsize


@dataclass(frozen=True)
class StorageFingerprint:
    """What must match for a stored page to be read back. model: the model's identity (its path's
    name and a hash of its config, say); the rest is the KV pool's layout."""

    model: str
    dtype: torch.dtype
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def digest(self) -> str:
        text = "|".join(
            map(
                str,
                (
                    FORMAT_VERSION,
                    self.model,
                    self.dtype,
                    self.page_size,
                    self.num_layers,
                    self.num_kv_heads,
                    self.head_dim,
                ),
            )
        )
        return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()

    @property
    def page_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.page_size, self.num_kv_heads, self.head_dim)

    @property
    def payload_offset(self) -> int:
        """Where the K/V start in a page's file: after the header and the token ids."""
        return _HEADER.size + _TOKEN * self.page_size

    @property
    def page_bytes(self) -> int:
        return self.payload_offset + self.kv_bytes

    @property
    def kv_bytes(self) -> int:
        """One page's K/V (the payload)."""
        return self.dtype.itemsize * int(torch.Size(self.page_shape).numel())

    def check_page(self, kv: torch.Tensor, tokens: Sequence[int]) -> None:
        """Raises ValueError unless kv and tokens are one page of this layout."""
        if tuple(kv.shape) != self.page_shape or kv.dtype != self.dtype:
            raise ValueError(f"a page is {self.page_shape} {self.dtype}, got {tuple(kv.shape)} {kv.dtype}")
        if len(tokens) != self.page_size:
            raise ValueError(f"a page holds {self.page_size} tokens, got {len(tokens)}")


def accounting_problems(level: str, used: int, budget: int, pages: int, page_bytes: int) -> list[str]:
    """What is wrong with a page store's byte count: over its budget, or not its pages' size."""
    problems = []
    if used > budget:
        problems.append(f"{level}: {used} bytes held > budget {budget}")
    if used != pages * page_bytes:
        problems.append(f"{level}: bytes held disagree with its pages")
    return problems


@dataclass(frozen=True)
class PageOrigin:
    """What a stored page holds the K/V of: its tokens, after the prefix its parent names."""

    parent_hash: int | None
    tokens: Sequence[int]


class FileKVStorage:
    def __init__(
        self,
        root: Path,
        fingerprint: StorageFingerprint,
        budget_bytes: int,
        events: KVEventRecorder | None = None,
    ) -> None:
        self.fingerprint = fingerprint
        self.digest = fingerprint.digest()
        self.directory = Path(root) / self.digest
        self.budget_bytes = budget_bytes
        self.events = events
        # Guards the index below against announce (scheduler thread) while the I/O thread changes
        # it; with events, the recorder's lock, so a change and its event are one step for a clear.
        self._lock = events.lock if events is not None else threading.RLock()
        self.enabled = True
        # page hash -> file bytes, least recently used first.
        self._pages: OrderedDict[int, int] = OrderedDict()
        # What each page holds: given to put, or read from its file's head when the directory is indexed.
        self._origins: dict[int, PageOrigin] = {}
        self.used_bytes = 0
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self._disable(f"cannot create {self.directory}: {e}")
            return
        self._scan()
        if events is not None:
            events.after_clear(self.announce)

    # ---- the pages -------------------------------------------------------------------------

    def __contains__(self, page_hash: int) -> bool:
        return self.enabled and page_hash in self._pages

    def __len__(self) -> int:
        return len(self._pages)

    def put(self, page_hash: int, kv: torch.Tensor, origin: PageOrigin) -> bool:
        """Stores one page's K/V (shape fingerprint.page_shape), of the tokens `origin` names;
        False when the tier is off or the page cannot fit the budget. A page already stored is only
        marked used."""
        if not self.enabled:
            return False
        if page_hash in self._pages:
            self._pages.move_to_end(page_hash)
            return True
        self.fingerprint.check_page(kv, origin.tokens)
        size = self.fingerprint.page_bytes
        if size > self.budget_bytes:
            return False
        while self.used_bytes + size > self.budget_bytes:
            self._remove(next(iter(self._pages)))
        payload = kv.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
        parent = -1 if origin.parent_hash is None else origin.parent_hash
        header = _HEADER.pack(
            _MAGIC, FORMAT_VERSION, self.digest.encode(), page_hash, parent, len(payload), zlib.crc32(payload)
        )
        path = self._path(page_hash)
        # Named per process: replicas sharing the directory may write the same page at once.
        partial = path.with_suffix(f".{os.getpid()}.partial")
        try:
            path.parent.mkdir(exist_ok=True)
            with open(partial, "wb") as f:
                f.write(header)
                f.write(array("q", origin.tokens).tobytes())
                f.write(payload)
            os.replace(partial, path)  # a reader never sees half a page
        except OSError as e:
            with contextlib.suppress(OSError):
                partial.unlink(missing_ok=True)
            self._disable(f"cannot write {path}: {e}")
            return False
        with self._lock:
            self._pages[page_hash] = size
            self._origins[page_hash] = PageOrigin(origin.parent_hash, array("q", origin.tokens))
            self.used_bytes += size
            if self.events is not None:
                self.events.stored([page_hash], origin.parent_hash, list(origin.tokens))
        return True

    def get(self, page_hash: int) -> torch.Tensor | None:
        """The page's K/V as stored (bit for bit), or None when it is not here or its file is bad
        (then the file is removed)."""
        if page_hash not in self:
            return None
        path = self._path(page_hash)
        try:
            data = path.read_bytes()
        except OSError:
            self._remove(page_hash)  # gone from under us: forgotten, announced as removed
            return None
        offset = self.fingerprint.payload_offset
        head = self._read_head(data, page_hash)
        if len(data) != self.fingerprint.page_bytes or head is None or zlib.crc32(data[offset:]) != head[1]:
            logger.warning("storage tier: refusing %s (not this model's page, or damaged)", path)
            self._remove(page_hash)
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # the least-recently-used order survives a restart
        self._pages.move_to_end(page_hash)
        flat = torch.frombuffer(bytearray(data[offset:]), dtype=torch.uint8)
        return flat.view(self.fingerprint.dtype).reshape(self.fingerprint.page_shape)

    def clear(self) -> None:
        with self._lock:
            removed = list(self._pages)
            for page_hash in removed:
                self._remove(page_hash, record=False)
            if removed and self.events is not None:
                self.events.removed(removed)

    def announce(self) -> None:
        """Records every page held as stored (the device tree's clear made subscribers forget
        them; at startup, the clear that opens the stream does). Runs inside the clear, under the
        recorder's lock."""
        if self.events is None or not self.enabled:
            return
        with self._lock:
            for page_hash in self._pages:
                origin = self._origins[page_hash]
                self.events.stored([page_hash], origin.parent_hash, list(origin.tokens))

    # ---- internals -------------------------------------------------------------------------

    def _path(self, page_hash: int) -> Path:
        name = f"{page_hash:016x}"
        return self.directory / name[:2] / f"{name}.kv"

    def _scan(self) -> None:
        """The pages an earlier process left, oldest use first. A page file of the wrong size, or
        whose head is not this model's page (cut short, corrupt, renamed), is removed: writers
        rename whole files into place, so it is damage, not a write in progress."""
        found: list[tuple[float, int, int, PageOrigin]] = []
        for path in self.directory.glob("*/*.kv"):
            try:
                page_hash = int(path.stem, 16)
                stat = path.stat()
                origin = None
                if stat.st_size == self.fingerprint.page_bytes:
                    with open(path, "rb") as f:
                        head = self._read_head(f.read(self.fingerprint.payload_offset), page_hash)
                    origin = head[0] if head is not None else None
                if origin is None:
                    logger.warning("storage tier: removing %s (not a whole page of this model)", path)
                    path.unlink()
                    continue
            except (ValueError, OSError):
                continue
            found.append((stat.st_mtime, page_hash, stat.st_size, origin))
        for _, page_hash, size, origin in sorted(found, key=lambda item: item[:2]):
            self._pages[page_hash] = size
            self._origins[page_hash] = origin
            self.used_bytes += size
        while self.used_bytes > self.budget_bytes and self._pages:
            self._remove(next(iter(self._pages)), record=False)  # a smaller budget than the last run's

    def _read_head(self, head: bytes, page_hash: int) -> tuple[PageOrigin, int] | None:
        """What a file's head (header and token ids) says the page holds, and its payload's CRC;
        None when it is not this model's page `page_hash`: another fingerprint or version, or a
        name that is not the hash of its tokens."""
        if len(head) < self.fingerprint.payload_offset:
            return None
        magic, version, digest, stored_hash, parent, payload, crc = _HEADER.unpack_from(head)
        expected = (_MAGIC, FORMAT_VERSION, self.digest.encode(), page_hash)
        if (magic, version, digest, stored_hash) != expected:
            return None
        if payload != self.fingerprint.page_bytes - self.fingerprint.payload_offset:
            return None
        tokens = array("q", head[_HEADER.size : self.fingerprint.payload_offset])
        parent_hash = None if parent == -1 else parent
        if chain_hash(parent_hash, tokens) != page_hash:
            return None
        return PageOrigin(parent_hash, tokens), crc

    def _remove(self, page_hash: int, record: bool = True) -> None:
        with self._lock:
            self.used_bytes -= self._pages.pop(page_hash)
            del self._origins[page_hash]
            if record and self.events is not None:
                self.events.removed([page_hash])
        try:
            self._path(page_hash).unlink(missing_ok=True)
        except OSError as e:
            self._disable(f"cannot remove {self._path(page_hash)}: {e}")

    def level_stats(self) -> dict[str, Any]:
        return {
            "hicache_storage_enabled": self.enabled,
            "hicache_storage_pages": len(self),
            "hicache_storage_bytes": self.used_bytes,
            "hicache_storage_budget_bytes": self.budget_bytes,
        }

    def check(self) -> list[str]:
        """Problems with this level's accounting (checked with the KV invariant when idle)."""
        return accounting_problems(
            "storage tier", self.used_bytes, self.budget_bytes, len(self), self.fingerprint.page_bytes
        )

    def disable(self, why: str) -> None:
        """Off for the rest of this process (the files stay), with one log line."""
        self._disable(why)

    def _disable(self, why: str) -> None:
        if not self.enabled:
            return
        logger.warning("storage tier off: %s; serving without it", why)
        with self._lock:
            self.enabled = False
            if self.events is not None and self._pages:
                self.events.removed(list(self._pages))  # no longer served from here
