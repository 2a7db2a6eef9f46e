"""The storage tier's file backend: K/V pages on disk, one file per page, named by its hash.

A page's hash (cache/block_hash.py) names its whole token prefix, so any process serving the same
model with the same KV layout finds the pages another wrote: across restarts, and across replicas
sharing a directory. What "the same" means is the fingerprint (StorageFingerprint): the model's
identity, the KV dtype, the page size, the pool's shape and this format's version. It names the
directory the pages live in and is written into every file's header, so a page written by
another model, dtype, page size or version is never found, and a file whose header disagrees
(moved, truncated, corrupted) is refused and removed, never loaded.

File layout: <root>/<fingerprint>/<2 hex digits>/<16 hex digits>.kv, holding a fixed header
(magic, version, fingerprint, page hash, payload bytes) and the payload: the page's K and V for
every layer, [num_layers, 2, page_size, kv_heads, head_dim] in the pool's dtype, as raw bytes.

Budget: the files together stay within `budget_bytes`; storing past it removes the least recently
used pages first (a load counts as a use and touches the file's mtime, so the order survives a
restart). Faults: an OSError while writing (a full disk, a read-only mount, no permission) turns
the tier off with one log line; the server goes on without it and no client sees an error.

This module is only the backend (synchronous, one caller at a time); the hierarchical tier that
writes evicted pages and loads them on a match, off the scheduler's thread, builds on it.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import struct
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
_MAGIC = b"RSKV"
# magic, version, fingerprint (16 hex digits as bytes), page hash, payload bytes
_HEADER = struct.Struct("<4sI16sQQ")


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
    def page_bytes(self) -> int:
        return _HEADER.size + self.dtype.itemsize * int(torch.Size(self.page_shape).numel())


class FileKVStorage:
    def __init__(self, root: Path, fingerprint: StorageFingerprint, budget_bytes: int) -> None:
        self.fingerprint = fingerprint
        self.digest = fingerprint.digest()
        self.directory = Path(root) / self.digest
        self.budget_bytes = budget_bytes
        self.enabled = True
        # page hash -> file bytes, least recently used first.
        self._pages: OrderedDict[int, int] = OrderedDict()
        self.used_bytes = 0
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self._disable(f"cannot create {self.directory}: {e}")
            return
        self._scan()

    # ---- the pages -------------------------------------------------------------------------

    def __contains__(self, page_hash: int) -> bool:
        return self.enabled and page_hash in self._pages

    def __len__(self) -> int:
        return len(self._pages)

    def put(self, page_hash: int, kv: torch.Tensor) -> bool:
        """Stores one page's K/V (shape fingerprint.page_shape); False when the tier is off or the
        page cannot fit the budget. A page already stored is only marked used."""
        if not self.enabled:
            return False
        if page_hash in self._pages:
            self._pages.move_to_end(page_hash)
            return True
        if tuple(kv.shape) != self.fingerprint.page_shape or kv.dtype != self.fingerprint.dtype:
            expected = f"{self.fingerprint.page_shape} {self.fingerprint.dtype}"
            raise ValueError(f"a page is {expected}, got {tuple(kv.shape)} {kv.dtype}")
        size = self.fingerprint.page_bytes
        if size > self.budget_bytes:
            return False
        while self.used_bytes + size > self.budget_bytes:
            self._remove(next(iter(self._pages)))
        payload = kv.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
        header = _HEADER.pack(_MAGIC, FORMAT_VERSION, self.digest.encode(), page_hash, len(payload))
        path = self._path(page_hash)
        # Named per process: replicas sharing the directory may write the same page at once.
        partial = path.with_suffix(f".{os.getpid()}.partial")
        try:
            path.parent.mkdir(exist_ok=True)
            with open(partial, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(partial, path)  # a reader never sees half a page
        except OSError as e:
            with contextlib.suppress(OSError):
                partial.unlink(missing_ok=True)
            self._disable(f"cannot write {path}: {e}")
            return False
        self._pages[page_hash] = size
        self.used_bytes += size
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
            self._forget(page_hash)
            return None
        payload_bytes = self.fingerprint.page_bytes - _HEADER.size
        if len(data) != self.fingerprint.page_bytes or _HEADER.unpack_from(data) != (
            _MAGIC,
            FORMAT_VERSION,
            self.digest.encode(),
            page_hash,
            payload_bytes,
        ):
            logger.warning("storage tier: refusing %s (its header or size is not this model's page)", path)
            self._remove(page_hash)
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # the least-recently-used order survives a restart
        self._pages.move_to_end(page_hash)
        flat = torch.frombuffer(bytearray(data[_HEADER.size :]), dtype=torch.uint8)
        return flat.view(self.fingerprint.dtype).reshape(self.fingerprint.page_shape)

    def clear(self) -> None:
        for page_hash in list(self._pages):
            self._remove(page_hash)

    # ---- internals -------------------------------------------------------------------------

    def _path(self, page_hash: int) -> Path:
        name = f"{page_hash:016x}"
        return self.directory / name[:2] / f"{name}.kv"

    def _scan(self) -> None:
        """The pages an earlier process left, oldest use first; files of the wrong size, or not
        named as pages, are left alone and not counted (a later get would refuse them anyway)."""
        found: list[tuple[float, int, int]] = []
        for path in self.directory.glob("*/*.kv"):
            try:
                page_hash = int(path.stem, 16)
                stat = path.stat()
            except (ValueError, OSError):
                continue
            if stat.st_size == self.fingerprint.page_bytes:
                found.append((stat.st_mtime, page_hash, stat.st_size))
        for _, page_hash, size in sorted(found):
            self._pages[page_hash] = size
            self.used_bytes += size
        while self.used_bytes > self.budget_bytes and self._pages:
            self._remove(next(iter(self._pages)))  # a smaller budget than the last run's

    def _forget(self, page_hash: int) -> None:
        self.used_bytes -= self._pages.pop(page_hash)

    def _remove(self, page_hash: int) -> None:
        self._forget(page_hash)
        try:
            self._path(page_hash).unlink(missing_ok=True)
        except OSError as e:
            self._disable(f"cannot remove {self._path(page_hash)}: {e}")

    def disable(self, why: str) -> None:
        """Off for the rest of this process (the files stay), with one log line."""
        self._disable(why)

    def _disable(self, why: str) -> None:
        if self.enabled:
            logger.warning("storage tier off: %s; serving without it", why)
        self.enabled = False
