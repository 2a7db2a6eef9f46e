"""Cache tiers: what the radix cache tells the levels below the device KV pool.

Today there is one tier, the device pool itself (DeviceOnlyTier: the hooks do nothing). A
hierarchical cache plugs in here: a host-memory or storage tier keeps what `on_evict` hands it
(the node's token path and its device slots, whose K/V are still intact during the call), and on
`on_match` it may bring a longer prefix back into the pool and return how many tokens it added
to the tree, so that the cache matches again. KV events (stored / removed blocks) hang off the
same two hooks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch


class CacheTier(ABC):
    name: str

    @abstractmethod
    def on_evict(self, tokens: Sequence[int], slots: torch.Tensor) -> None:
        """A tree node leaves the device pool. tokens: its whole key from the root (the prefix it
        extends, then its own tokens); slots: the device KV slots of its own tokens, the last
        len(slots) of tokens. Called before the slots are freed."""

    @abstractmethod
    def on_match(self, tokens: Sequence[int], matched: int) -> int:
        """A lookup of tokens matched its first `matched` on device. Returns how many more tokens
        the tier inserted into the tree (0: none), after which the cache matches again."""


class DeviceOnlyTier(CacheTier):
    """The device pool is the only level: evicted K/V is gone, a miss is recomputed."""

    name = "device"

    def on_evict(self, tokens: Sequence[int], slots: torch.Tensor) -> None:
        return None

    def on_match(self, tokens: Sequence[int], matched: int) -> int:
        return 0
