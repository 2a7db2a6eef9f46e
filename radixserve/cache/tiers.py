"""Cache tiers: what the radix cache tells the levels below the device KV pool, and how they give
K/V back.

The device pool is L1. DeviceOnlyTier (the default) keeps nothing below it. StorageTier
(cache/storage_tier.py, --enable-hierarchical-cache --hicache-storage-backend file) keeps pages on
disk: it is told of every page that enters the tree (`on_insert`, write-through) and of every node
that leaves it (`on_evict`, write-back), while their K/V are still in the pool; a waiting request
asks it for more of its prefix (`prefetch`), which loads off the scheduler's thread while the
request waits in the queue, and `install` puts finished loads into the tree on the scheduler's
thread, so that the request's next match finds them. KV events (stored / removed blocks) hang off
the same places in the radix cache.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


class MatchedPrefix(Protocol):
    """What a tier reads of a lookup (cache/radix_cache.py MatchResult)."""

    @property
    def kv_indices(self) -> torch.Tensor: ...

    @property
    def last_node(self) -> Any: ...

    def __len__(self) -> int: ...


class PrefixTree(Protocol):
    """The radix cache as a tier installs loads into it (cache/radix_cache.py RadixCache); a
    protocol, so that this module does not import the cache that imports it."""

    def match_prefix(self, key: Sequence[int]) -> MatchedPrefix: ...

    def insert(self, key: Sequence[int], value: torch.Tensor) -> int: ...

    def inc_lock_ref(self, node: Any) -> None: ...

    def dec_lock_ref(self, node: Any) -> None: ...

    def evict(self, num_tokens: int) -> int: ...


@dataclass
class TierLoad:
    """A prefix being loaded for a waiting request: done once `install` has put it into the tree
    (or given it up); tokens: how many of the request's tokens it brought into the tree."""

    done: bool = False
    tokens: int = 0
    # The loader's own state (cache/storage_tier.py).
    detail: Any = field(default=None, repr=False)


class CacheTier(ABC):
    name: str

    @abstractmethod
    def on_insert(self, tokens: Sequence[int], slots: torch.Tensor, new_from: int) -> None:
        """Tokens [new_from, len(tokens)) entered the tree as a new node. tokens: its whole key
        from the root; slots: the slots inserted with, for all of it (the inserting request's own
        copies of the prefix, where it has them, hold the same K/V as the tree's)."""

    @abstractmethod
    def on_evict(self, tokens: Sequence[int], slots: torch.Tensor, own_from: int) -> None:
        """A leaf leaves the device pool: tokens [own_from, len(tokens)) are its own. tokens, slots:
        as for on_insert. Called before its slots are freed (their K/V are intact)."""

    @abstractmethod
    def prefetch(self, tokens: Sequence[int], matched: torch.Tensor) -> TierLoad | None:
        """A waiting request's prompt `tokens`, of which the device tree holds the first
        len(matched) (at those slots). Returns a load to wait for (finished already when it reads
        from memory: the next `install` puts it in the tree), or None: nothing more here."""

    @abstractmethod
    def install(self, cache: PrefixTree) -> None:
        """On the scheduler's thread, before a prefill batch is chosen: finished loads into the
        tree, each TierLoad then done."""

    def clear(self) -> None:
        """Drop everything this tier keeps (/clear_hicache_storage_backend; /flush_cache flushes
        the device tree alone)."""
        return None

    @property
    def loading(self) -> bool:
        """Loads that have not reached the tree yet (each has a request waiting on it)."""
        return False

    def wait_for_loads(self, timeout_s: float) -> None:
        """Nothing else to run: sleep until a load finishes (at most timeout_s)."""
        return None

    def weights_changed(self) -> None:
        """The model's weights were replaced: what this tier keeps no longer matches them."""
        return None

    def check_invariant(self) -> list[str]:
        """Problems with this tier's own accounting, checked with the KV invariant when idle."""
        return []

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        return None


class DeviceOnlyTier(CacheTier):
    """The device pool is the only level: evicted K/V is gone, a miss is recomputed."""

    name = "device"

    def on_insert(self, tokens: Sequence[int], slots: torch.Tensor, new_from: int) -> None:
        return None

    def on_evict(self, tokens: Sequence[int], slots: torch.Tensor, own_from: int) -> None:
        return None

    def prefetch(self, tokens: Sequence[int], matched: torch.Tensor) -> TierLoad | None:
        return None

    def install(self, cache: PrefixTree) -> None:
        return None
