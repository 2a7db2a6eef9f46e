"""KV cache events from the radix cache (cache/kv_events.py, cache/block_hash.py): every page the
tree stores or removes is reported once, by a hash that names its whole prefix, in the wire shape
of vLLM's KVEventBatch."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.cache.block_hash import page_hash, page_hashes
from radixserve.cache.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventRecorder,
)
from radixserve.cache.pools import KVSlotAllocator, ReqToTokenPool
from radixserve.cache.radix_cache import RadixCache


def make(page_size: int, slots: int = 256) -> tuple[RadixCache, KVEventRecorder]:
    recorder = KVEventRecorder(page_size, "CPU")
    cache = RadixCache(
        ReqToTokenPool(4, slots), KVSlotAllocator(slots, page_size), page_size, events=recorder
    )
    return cache, recorder


def insert(cache: RadixCache, tokens: list[int]) -> None:
    slots = cache.allocator.alloc_extend([0], [-1], [len(tokens)])
    assert slots is not None
    already = cache.insert(tokens, slots)
    cache.allocator.free(slots[:already])


def events(recorder: KVEventRecorder) -> list[object]:
    batch = recorder.take()
    return [] if batch is None else list(batch.events)


def test_page_hashes_chain_the_prefix() -> None:
    first = page_hashes(None, [1, 2, 3, 4], 2)
    assert first == [page_hash(None, [1, 2]), page_hash(page_hash(None, [1, 2]), [3, 4])]
    assert page_hashes(first[0], [3, 4], 2) == first[1:]
    # The same page under another prefix is another block.
    assert page_hashes(None, [3, 4], 2) != first[1:]
    assert all(0 <= h < 2**63 for h in first)


def test_stores_report_new_pages_with_their_parent_and_splits_report_nothing() -> None:
    cache, recorder = make(page_size=2)
    assert events(recorder) == [AllBlocksCleared()]  # a new cache starts from nothing
    insert(cache, [1, 2, 3, 4, 5, 6])
    chain = page_hashes(None, [1, 2, 3, 4, 5, 6], 2)
    assert events(recorder) == [BlockStored(chain, None, [1, 2, 3, 4, 5, 6], 2, None, "CPU")]
    # Splits the node after [1, 2, 3, 4]: only the new branch's page is new.
    insert(cache, [1, 2, 3, 4, 7, 8])
    assert events(recorder) == [BlockStored([page_hash(chain[1], [7, 8])], chain[1], [7, 8], 2, None, "CPU")]
    insert(cache, [1, 2, 3, 4])  # all present: nothing stored
    assert recorder.take() is None
    assert cache.evict(100) == 8
    removed = [h for e in events(recorder) if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert sorted(removed) == sorted([*chain, page_hash(chain[1], [7, 8])])
    cache.check_invariant()


def test_a_reset_clears_all_blocks_and_drops_what_was_pending() -> None:
    cache, recorder = make(page_size=1)
    recorder.take()
    insert(cache, [5, 6, 7])
    cache.reset()
    cache.allocator.clear()  # as the scheduler's flush does
    assert events(recorder) == [AllBlocksCleared()]
    cache.check_invariant()


def test_the_batch_encodes_as_vllm_s_tagged_arrays() -> None:
    batch = KVEventBatch(
        ts=1.5,
        events=[
            BlockStored([7, 8], None, [1, 2], 1, None, "CPU"),
            BlockRemoved([7], "CPU"),
            AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(batch))
    assert raw == [
        1.5,
        [
            ["BlockStored", [7, 8], None, [1, 2], 1, None, "CPU"],
            ["BlockRemoved", [7], "CPU"],
            ["AllBlocksCleared"],
        ],
        0,
    ]
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(batch), type=KVEventBatch) == batch


class Subscriber:
    """What a KV-aware router keeps: the blocks stored and not removed since the last clear."""

    def __init__(self) -> None:
        self.blocks: set[int] = set()

    def apply(self, recorder: KVEventRecorder) -> None:
        for event in events(recorder):
            if isinstance(event, AllBlocksCleared):
                self.blocks.clear()
            elif isinstance(event, BlockStored):
                assert not self.blocks & set(event.block_hashes), "a block stored twice"
                self.blocks.update(event.block_hashes)
            else:
                assert isinstance(event, BlockRemoved)
                assert set(event.block_hashes) <= self.blocks, "a block removed that was never stored"
                self.blocks.difference_update(event.block_hashes)


def tree_blocks(cache: RadixCache) -> set[int]:
    nodes = cache._iter_nodes()
    for node in nodes:
        assert len(node.hashes) * cache.page_size == len(node.key)
    return {h for node in nodes for h in node.hashes}


@settings(max_examples=60, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 4]),
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("insert"), st.lists(st.integers(0, 3), min_size=1, max_size=6)),
            st.tuples(st.just("evict"), st.integers(1, 12)),
            st.tuples(st.just("reset"), st.just(0)),
        ),
        max_size=25,
    ),
)
def test_a_subscriber_following_the_events_knows_exactly_the_tree_s_blocks(
    page_size: int, ops: list[tuple[str, object]]
) -> None:
    cache, recorder = make(page_size, slots=4096)
    subscriber = Subscriber()
    for op, arg in ops:
        if op == "insert":
            assert isinstance(arg, list)
            tokens = [t for t in arg for _ in range(page_size)]  # whole pages
            insert(cache, tokens)
        elif op == "evict":
            assert isinstance(arg, int)
            cache.evict(arg)
        else:
            cache.reset()
            cache.allocator.clear()
        subscriber.apply(recorder)
        assert subscriber.blocks == tree_blocks(cache)
    cache.evict(10**6)
    subscriber.apply(recorder)
    assert subscriber.blocks == set()
    cache.check_invariant()
