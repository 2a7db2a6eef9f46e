"""The hierarchical cache flags (SGLang's names), their checks and their command-line form.

L1 is the device KV pool. SGLang's L2 is a host-memory pool beside a GPU's; on a CPU the device
pool is host memory already, so there is no separate L2 and --hicache-ratio / --hicache-size are
accepted and unused there (a log line says so). The storage tier (cache/storage_tier.py) is a
directory of page files: --hicache-storage-backend file."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Protocol

WRITE_POLICIES: tuple[str, ...] = ("write_through", "write_back", "write_through_selective")
STORAGE_BACKENDS: tuple[str, ...] = ("file",)
# SGLang's file backend reads its directory from this variable; radixserve does too, after the flag.
STORAGE_DIR_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"
DEFAULT_STORAGE_PAGE_TOKENS = 64


class HiCacheFields(Protocol):
    enable_hierarchical_cache: bool
    hicache_ratio: float
    hicache_size: int
    hicache_write_policy: str
    hicache_storage_backend: str | None
    hicache_storage_dir: str | None
    hicache_storage_size_gb: float
    hicache_storage_page_size: int | None
    page_size: int
    disable_radix_cache: bool


def validate_hicache_args(args: HiCacheFields, error: type[ValueError]) -> None:
    if not args.enable_hierarchical_cache:
        if args.hicache_storage_backend is not None:
            raise error("--hicache-storage-backend needs --enable-hierarchical-cache")
        return
    if args.disable_radix_cache:
        raise error("--enable-hierarchical-cache needs the radix cache: drop --disable-radix-cache")
    if args.hicache_write_policy not in WRITE_POLICIES:
        raise error(f"--hicache-write-policy must be one of {', '.join(WRITE_POLICIES)}")
    if args.hicache_ratio <= 0 or args.hicache_size < 0:
        raise error("--hicache-ratio must be > 0 and --hicache-size >= 0")
    backend = args.hicache_storage_backend
    if backend is not None and backend not in STORAGE_BACKENDS:
        raise error(
            f"--hicache-storage-backend {backend!r} is not available here; this build has: "
            f"{', '.join(STORAGE_BACKENDS)}"
        )
    if args.hicache_storage_size_gb <= 0:
        raise error("--hicache-storage-size-gb must be > 0")
    page = args.hicache_storage_page_size
    if page is None:
        page = max(args.page_size, DEFAULT_STORAGE_PAGE_TOKENS)
        page -= page % args.page_size
    if page < 1 or page % args.page_size:
        raise error("--hicache-storage-page-size must be a positive multiple of --page-size")
    args.hicache_storage_page_size = page


def storage_dir(args: HiCacheFields) -> Path:
    """Where the file backend keeps its pages: the flag, else SGLang's variable, else the user's
    cache directory."""
    if args.hicache_storage_dir:
        return Path(args.hicache_storage_dir)
    if os.environ.get(STORAGE_DIR_ENV):
        return Path(os.environ[STORAGE_DIR_ENV])
    return Path.home() / ".cache" / "radixserve" / "hicache"


def add_hicache_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("hierarchical cache")
    group.add_argument(
        "--enable-hierarchical-cache",
        action="store_true",
        help="keep prefixes below the device pool (--hicache-storage-backend: on disk, across restarts)",
    )
    group.add_argument(
        "--hicache-ratio", type=float, help="L2 host pool / device pool (unused on a CPU: no L2)"
    )
    group.add_argument(
        "--hicache-size",
        type=int,
        help="L2 host pool in GB, over --hicache-ratio (unused on a CPU)",
    )
    group.add_argument("--hicache-write-policy", choices=WRITE_POLICIES)
    group.add_argument(
        "--hicache-storage-backend",
        help="file: K/V pages as files in --hicache-storage-dir, named by the hash of their tokens",
    )
    group.add_argument(
        "--hicache-storage-dir",
        help=f"the file backend's directory (default ${STORAGE_DIR_ENV}, else ~/.cache/radixserve/hicache)",
    )
    group.add_argument(
        "--hicache-storage-size-gb",
        type=float,
        help="disk budget (least recently used pages go)",
    )
    group.add_argument(
        "--hicache-storage-page-size",
        type=int,
        help=f"tokens per stored page, a multiple of --page-size (default {DEFAULT_STORAGE_PAGE_TOKENS})",
    )
