"""The radix cache's tier hooks (cache/tiers.py): what a lower tier is told, and that a tier which
puts a prefix back into the tree makes the lookup match it."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixserve.cache.pools import KVSlotAllocator, ReqToTokenPool
from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.tiers import CacheTier, DeviceOnlyTier


class RecordingTier(CacheTier):
    """Keeps the token paths it was handed on eviction (as a host tier would keep their K/V), and
    on a lookup that matches less than it holds, puts the rest back into the tree."""

    name = "recording"

    def __init__(self) -> None:
        self.cache: RadixCache | None = None
        self.evicted: list[tuple[list[int], list[int]]] = []
        self.matches: list[tuple[list[int], int]] = []
        self.reload = False

    def on_evict(self, tokens: Sequence[int], slots: torch.Tensor) -> None:
        self.evicted.append((list(tokens), slots.tolist()))

    def on_match(self, tokens: Sequence[int], matched: int) -> int:
        self.matches.append((list(tokens), matched))
        if not self.reload or self.cache is None:
            return 0
        held = max(
            (path for path, _ in self.evicted if list(tokens[: len(path)]) == path), key=len, default=[]
        )
        if len(held) <= matched:
            return 0
        # Fresh device slots for the whole path (a real tier would copy the K/V back into them).
        slots = self.cache.allocator.alloc_extend([0], [-1], [len(held)])
        assert slots is not None
        already = self.cache.insert(held, slots)
        self.cache.allocator.free(slots[:already])  # the tree kept its own slots for that part
        return len(held) - already


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


def test_evictions_hand_the_tier_each_node_with_its_whole_token_path() -> None:
    tier = RecordingTier()
    cache = make(tier)
    first = insert(cache, [1, 2, 3, 4, 5])
    second = insert(cache, [1, 2, 3, 7, 8])  # splits the first: [1, 2, 3] then [4, 5] and [7, 8]
    assert cache.evict(100) == 7
    paths = sorted(tier.evicted)
    assert paths == sorted([
        ([1, 2, 3, 4, 5], first[3:].tolist()),
        ([1, 2, 3, 7, 8], second[3:].tolist()),
        ([1, 2, 3], first[:3].tolist()),
    ])  # fmt: skip
    # The parent goes last: it becomes a leaf only once both children are gone.
    assert tier.evicted[-1][0] == [1, 2, 3]
    cache.check_invariant()
    assert cache.allocator.available_size() == cache.allocator.total_slots


def test_lookups_tell_the_tier_how_much_matched_on_device() -> None:
    tier = RecordingTier()
    cache = make(tier)
    insert(cache, [5, 6, 7])
    cache.match_prefix([5, 6, 9, 9])
    cache.match_prefix([8])
    assert tier.matches == [([5, 6, 9, 9], 2), ([8], 0)]


def test_a_tier_that_reloads_a_prefix_extends_the_match() -> None:
    tier = RecordingTier()
    cache = make(tier)
    tier.cache = cache
    insert(cache, [1, 2, 3, 4, 5, 6])
    cache.evict(100)
    assert cache.evictable_size() == 0
    tier.reload = True
    match = cache.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert len(match) == 6  # matched again after the tier put the six tokens back
    assert cache.evictable_size() == 6
    cache.check_invariant()  # free + evictable == total: the reloaded slots belong to the tree
