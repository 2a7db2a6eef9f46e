"""Queue order and prefill budgets, on a real radix cache without a model."""

from __future__ import annotations

from radixserve.cache.pools import KVSlotAllocator, ReqToTokenPool
from radixserve.cache.radix_cache import RadixCache
from radixserve.protocol.sampling_params import SamplingParams
from radixserve.scheduler.policy import IN_BATCH_PREFIX_TOKENS, AddResult, PrefillAdder, SchedulePolicy
from radixserve.scheduler.request import Req


def _cache(slots: int = 1000) -> RadixCache:
    return RadixCache(ReqToTokenPool(8, 512), KVSlotAllocator(slots, 1), 1)


def _req(rid: str, ids: list[int], max_new: int = 8) -> Req:
    return Req(rid, ids, SamplingParams(max_new_tokens=max_new))


def _cache_tokens(cache: RadixCache, ids: list[int]) -> None:
    slots = cache.allocator.alloc_extend([0], [-1], [len(ids)])
    assert slots is not None
    cache.insert(ids, slots)


def test_fcfs_and_lof_orders() -> None:
    cache = _cache()
    a, b, c = _req("a", [1, 2], 5), _req("b", [3, 4], 50), _req("c", [5, 6], 20)
    assert [r.rid for r in SchedulePolicy("fcfs", cache).order([c, a, b])] == ["a", "b", "c"]
    assert [r.rid for r in SchedulePolicy("lof", cache).order([a, b, c])] == ["b", "c", "a"]
    assert sorted(r.rid for r in SchedulePolicy("random", cache).order([a, b, c])) == ["a", "b", "c"]


def test_lpm_puts_longest_cached_prefix_first() -> None:
    cache = _cache()
    _cache_tokens(cache, list(range(100, 140)))
    short = _req("short", list(range(100, 105)) + [7, 8])
    long = _req("long", list(range(100, 130)) + [9])
    none = _req("none", [1, 2, 3])
    assert [r.rid for r in SchedulePolicy("lpm", cache).order([none, short, long])] == [
        "long",
        "short",
        "none",
    ]


def test_dfs_weight_groups_requests_of_the_heaviest_branch() -> None:
    cache = _cache()
    _cache_tokens(cache, [1] * 10 + [2] * 10)
    _cache_tokens(cache, [3] * 10)
    light = _req("light", [3] * 10 + [4])
    heavy = [_req(f"h{i}", [1] * 10 + [2] * 10 + [i + 5]) for i in range(2)]
    order = [r.rid for r in SchedulePolicy("dfs-weight", cache).order([light, *heavy])]
    assert order == ["h0", "h1", "light"]


def test_in_batch_dedup_defers_requests_sharing_an_uncached_prefix() -> None:
    cache = _cache()
    prefix = list(range(200, 200 + IN_BATCH_PREFIX_TOKENS + 8))
    first, second, other = _req("1", [*prefix, 1]), _req("2", [*prefix, 2]), _req("x", list(range(300, 350)))
    candidates = SchedulePolicy("lpm", cache).order([first, second, other])
    assert [r.rid for r in candidates] == ["1", "x"]
    # fcfs is not cache-aware: it schedules everything in arrival order.
    assert len(SchedulePolicy("fcfs", cache).order([first, second, other])) == 3


def _adder(
    cache: RadixCache, reserved: float = 0.0, chunk: int | None = None, max_prefill: int = 10_000
) -> PrefillAdder:
    return PrefillAdder(
        tree_cache=cache,
        available_slots=cache.allocator.available_size(),
        running_reserved=reserved,
        max_prefill_tokens=max_prefill,
        chunk_budget=chunk,
        page_size=1,
    )


def test_adder_stops_when_the_kv_budget_is_spent() -> None:
    cache = _cache(slots=100)
    adder = _adder(cache, reserved=20)
    assert adder.add_one_req(_req("a", [1] * 40, max_new=10), has_chunked_req=False) is AddResult.CONTINUE
    # 100 - 20 reserved - 50 admitted = 30 left; this one needs 25 + 10.
    assert adder.add_one_req(_req("b", [2] * 25, max_new=10), has_chunked_req=False) is AddResult.NO_TOKEN
    assert [r.rid for r in adder.can_run] == ["a"]


def test_adder_chunks_a_long_prompt_and_locks_the_prefix() -> None:
    cache = _cache()
    _cache_tokens(cache, list(range(10, 30)))
    adder = _adder(cache, chunk=16)
    req = _req("long", list(range(10, 30)) + [7] * 50)
    assert adder.add_one_req(req, has_chunked_req=False) is AddResult.OTHER
    assert adder.new_chunked_req is req and req.extend_len == 16
    assert req.prefix_slots is not None and len(req.prefix_slots) == 20
    assert cache.protected_size() == 20 and cache.evictable_size() == 0
    # A second long prompt cannot be chunked in the same round.
    assert adder.add_one_req(_req("other", [9] * 50), has_chunked_req=False) is AddResult.OTHER
    assert req.prefix_node is not None
    cache.dec_lock_ref(req.prefix_node)


def test_adder_respects_max_prefill_tokens_but_always_admits_one() -> None:
    cache = _cache()
    adder = _adder(cache, max_prefill=30)
    assert adder.add_one_req(_req("big", [1] * 50), has_chunked_req=False) is AddResult.CONTINUE
    assert adder.add_one_req(_req("next", [2] * 5), has_chunked_req=False) is AddResult.OTHER
    for req in adder.can_run:
        assert req.prefix_node is not None
        cache.dec_lock_ref(req.prefix_node)
    assert adder.prefill_tokens == 50
