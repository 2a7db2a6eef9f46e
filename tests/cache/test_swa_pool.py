"""Window slots (cache/swa_pool.py): the sliding layers' K/V held while some request may attend it,
and the radix tree continuing only from prefixes whose last window is alive."""

from __future__ import annotations

import torch

from radixserve.cache.pools import ReqToTokenPool
from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.swa_pool import WindowSlotAllocator
from tests.cache.test_radix_cache import FakeReq


def _slots(alloc: WindowSlotAllocator, n: int) -> torch.Tensor:
    taken = alloc.alloc_extend([0], [-1], [n])
    assert taken is not None
    return taken


def test_every_slot_takes_a_window_slot_and_gives_it_back_once() -> None:
    alloc = WindowSlotAllocator(16, window=4)
    taken = _slots(alloc, 10)
    held = alloc.window_map[taken]
    assert sorted(held.tolist()) == list(range(10))
    assert alloc.window_available() == 6
    alloc.release_window(taken[:3])
    alloc.release_window(taken[:5])  # the first three again: nothing more to give back
    assert alloc.window_available() == 11
    assert (alloc.window_map[taken[:5]] == alloc.released).all()
    # The most recently released window slots are the first reused: the memory touched stays that
    # of the windows alive.
    again = alloc.alloc_decode([10], [int(taken[-1])])
    assert again is not None and int(alloc.window_map[again]) in held[:5].tolist()
    alloc.free(torch.cat([taken, again]))
    assert alloc.available_size() == alloc.window_available() == 16
    assert alloc.window_leak(taken[:0]) is None


def test_a_prefix_is_reusable_up_to_a_length_whose_last_window_is_alive() -> None:
    alloc = WindowSlotAllocator(32, window=4)
    taken = _slots(alloc, 20)
    assert alloc.reusable_prefix_len(taken) == 20
    alloc.release_window(taken[5:12])  # positions 5..11 dead
    # From length L a request reads positions L - 3 .. L - 1: all alive for L <= 5 or L >= 15.
    assert alloc.reusable_prefix_len(taken) == 20
    assert alloc.reusable_prefix_len(taken[:15]) == 15
    assert alloc.reusable_prefix_len(taken[:14]) == 5
    assert alloc.reusable_prefix_len(taken[:5]) == 5
    alloc.release_window(taken[3:4])
    assert alloc.reusable_prefix_len(taken[:14]) == 3
    alloc.release_window(taken[:1])
    assert alloc.reusable_prefix_len(taken[:14]) == 0


def test_the_cache_adopts_a_duplicate_s_window_and_matches_only_reusable_prefixes() -> None:
    alloc = WindowSlotAllocator(64, window=4)
    pool = ReqToTokenPool(4, 64)
    cache = RadixCache(pool, alloc)
    tokens = list(range(100, 120))

    # A finished request whose positions 0..9 left every window: the tree keeps them without
    # their window K/V.
    first = FakeReq(last_node=cache.root, req_pool_idx=pool.alloc(), kv_len=20)
    assert first.req_pool_idx is not None
    pool.req_to_token[first.req_pool_idx, :20] = _slots(alloc, 20)
    alloc.release_window(pool.req_to_token[first.req_pool_idx, :10])
    cache.cache_finished_req(first, tokens)
    assert alloc.window_leak(cache._held_slots()) is None

    assert len(cache.match_prefix(tokens)) == 20  # its last window is alive
    assert len(cache.match_prefix(tokens[:12])) == 0  # positions 9..11 would be read: 9 is dead
    assert len(cache.match_prefix(tokens[:16] + [1, 2])) == 16

    # A second request computed the same 14 tokens itself; caching them, the tree's copies of the
    # dead positions take its window K/V, and its duplicates go back whole.
    second = FakeReq(last_node=cache.root, req_pool_idx=pool.alloc(), kv_len=14)
    assert second.req_pool_idx is not None
    own = _slots(alloc, 14)
    pool.req_to_token[second.req_pool_idx, :14] = own
    cache.cache_unfinished_req(second, tokens[:14])
    assert (alloc.window_map[own] == alloc.released).all()
    assert len(cache.match_prefix(tokens[:12])) == 12
    cache.cache_finished_req(second, tokens[:14])
    cache.check_invariant()
    assert alloc.available_size() + cache.evictable_size() == 64
    cache.evict(64)
    cache.check_invariant()
    assert alloc.window_available() == 64


def test_over_its_budget_the_cache_gives_back_its_least_recently_used_window_kv() -> None:
    alloc = WindowSlotAllocator(64, window=4, budget=24)
    pool = ReqToTokenPool(4, 64)
    cache = RadixCache(pool, alloc)

    def finish(tokens: list[int]) -> torch.Tensor:
        req = FakeReq(last_node=cache.root, req_pool_idx=pool.alloc(), kv_len=len(tokens))
        assert req.req_pool_idx is not None
        own = _slots(alloc, len(tokens))
        pool.req_to_token[req.req_pool_idx, : len(tokens)] = own
        cache.cache_finished_req(req, tokens)
        return own

    oldest = finish(list(range(100, 110)))
    middle = finish(list(range(200, 210)))
    assert alloc.window_excess() == 0 and alloc.window_available() == 44  # 20 in use: within 24

    # A running request's chunk, locked in the tree: its window K/V is never taken.
    running = FakeReq(last_node=cache.root, req_pool_idx=pool.alloc(), kv_len=10)
    assert running.req_pool_idx is not None
    own = _slots(alloc, 10)
    pool.req_to_token[running.req_pool_idx, :10] = own
    cache.cache_unfinished_req(running, list(range(300, 310)))

    # 30 in use, past 24: down to 21 (budget - budget / 8), the least recently used node first,
    # whole nodes, skipping the locked one.
    assert (alloc.window_map[oldest] == alloc.released).all()
    assert (alloc.window_map[middle] != alloc.released).all()
    assert (alloc.window_map[own] != alloc.released).all()
    assert alloc.window_available() == 44
    # Its full layers' K/V is still cached, but nothing continues from it: its last window is gone.
    assert len(cache.match_prefix(list(range(100, 110)))) == 0
    assert len(cache.match_prefix(list(range(200, 210)))) == 10

    cache.cache_finished_req(running, list(range(300, 310)))
    newest = finish(list(range(400, 410)))  # 30 again: the middle one goes now, the running one's stays
    assert (alloc.window_map[middle] == alloc.released).all()
    assert (alloc.window_map[torch.cat([own, newest])] != alloc.released).all()
    cache.check_invariant()
    assert alloc.available_size() + cache.evictable_size() == 64
