"""The radix cache's tier hooks (cache/tiers.py): what a lower tier is told of insertions and
evictions. Loading back is cache/storage_tier.py's (tests/cache/test_storage_tier.py)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixserve.cache.pools import KVSlotAllocator, ReqToTokenPool
from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.tiers import CacheTier, DeviceOnlyTier, PrefixTree, TierLoad


class RecordingTier(CacheTier):
    """Keeps what it was told: each insertion's and eviction's token path, slots and split."""

    name = "recording"

    def __init__(self) -> None:
        self.inserted: list[tuple[list[int], list[int], int]] = []
        self.evicted: list[tuple[list[int], list[int], int]] = []

    def on_insert(self, tokens: Sequence[int], slots: torch.Tensor, new_from: int) -> None:
        self.inserted.append((list(tokens), slots.tolist(), new_from))

    def on_evict(self, tokens: Sequence[int], slots: torch.Tensor, own_from: int) -> None:
        self.evicted.append((list(tokens), slots.tolist(), own_from))

    def prefetch(self, tokens: Sequence[int], matched: torch.Tensor) -> TierLoad | None:
        return None

    def install(self, cache: PrefixTree) -> None:
        return None


def make(tier: CacheTier | None = None) -> RadixCache:
    return RadixCache(ReqToTokenPool(4, 64), KVSlotAllocator(64, 1), 1, tier)


def insert(cache: RadixCache, tokens: list[int]) -> torch.Tensor:
    slots = cache.allocator.alloc_extend([0], [-1], [len(tokens)])
    assert slots is not None
    already = cache.insert(tokens, slots)
    cache.allocator.free(slots[:already])
    return slots


def test_the_default_tier_is_the_device_pool_alone() -> None:
    cache = make()
    assert isinstance(cache.tier, DeviceOnlyTier)
    insert(cache, [1, 2, 3, 4])
    assert len(cache.match_prefix([1, 2, 3, 9])) == 3
    cache.evict(100)
    assert len(cache.match_prefix([1, 2, 3])) == 0
    cache.check_invariant()


def test_insertions_and_evictions_hand_the_tier_each_node_with_its_whole_path() -> None:
    tier = RecordingTier()
    cache = make(tier)
    first = insert(cache, [1, 2, 3, 4, 5])
    second = insert(cache, [1, 2, 3, 7, 8])  # splits the first: [1, 2, 3] then [4, 5] and [7, 8]
    # The slots the caller inserted with (its copies of the prefix hold the same K/V as the tree's).
    assert tier.inserted == [([1, 2, 3, 4, 5], first.tolist(), 0), ([1, 2, 3, 7, 8], second.tolist(), 3)]
    assert cache.evict(100) == 7
    paths = sorted(tier.evicted)
    assert paths == sorted([
        ([1, 2, 3, 4, 5], first.tolist(), 3),
        ([1, 2, 3, 7, 8], [*first[:3].tolist(), *second[3:].tolist()], 3),
        ([1, 2, 3], first[:3].tolist(), 0),
    ])  # fmt: skip
    # The parent goes last: it becomes a leaf only once both children are gone.
    assert tier.evicted[-1][0] == [1, 2, 3]
    cache.check_invariant()
    assert cache.allocator.available_size() == cache.allocator.total_slots
