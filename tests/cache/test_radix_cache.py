from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field

import pytest
import torch

from radixserve.cache.pools import KVSlotAllocator, ReqToTokenPool
from radixserve.cache.radix_cache import (
    ChunkCache,
    KVLeakError,
    PrefixCache,
    RadixCache,
    TreeNode,
)


@dataclass
class FakeReq:
    last_node: TreeNode
    tokens: list[int] = field(default_factory=list)
    req_pool_idx: int | None = None
    kv_len: int = 0
    cached_len: int = 0


def make(
    page_size: int = 1, num_slots: int = 64, num_reqs: int = 4, chunk: bool = False
) -> tuple[ReqToTokenPool, KVSlotAllocator, PrefixCache]:
    pool = ReqToTokenPool(num_reqs, 128)
    alloc = KVSlotAllocator(num_slots, page_size)
    cls = ChunkCache if chunk else RadixCache
    return pool, alloc, cls(pool, alloc, page_size)


def slots(alloc: KVSlotAllocator, n: int) -> torch.Tensor:
    s = alloc.alloc_extend([0], [-1], [n])
    assert s is not None
    return s


def radix(cache: PrefixCache) -> RadixCache:
    assert isinstance(cache, RadixCache)
    return cache


# ---- request-flow helpers (what the scheduler does) --------------------------


def start(cache: PrefixCache, pool: ReqToTokenPool, tokens: list[int]) -> FakeReq:
    m = cache.match_prefix(tokens)
    idx = pool.alloc()
    assert idx is not None
    n = len(m)
    pool.req_to_token[idx, :n] = m.kv_indices
    cache.inc_lock_ref(m.last_node)
    return FakeReq(last_node=m.last_node, tokens=list(tokens), req_pool_idx=idx, kv_len=n, cached_len=n)


def extend(cache: PrefixCache, req: FakeReq, n: int) -> torch.Tensor | None:
    assert req.req_pool_idx is not None
    row = cache.req_to_token_pool.req_to_token[req.req_pool_idx]
    last = int(row[req.kv_len - 1]) if req.kv_len else -1
    new = cache.allocator.alloc_extend([req.kv_len], [last], [n])
    if new is None:
        cache.evict(n + cache.page_size)
        new = cache.allocator.alloc_extend([req.kv_len], [last], [n])
    if new is not None:
        row[req.kv_len : req.kv_len + n] = new
        req.kv_len += n
    return new


def path_value(node: TreeNode) -> list[int]:
    parts: list[int] = []
    cur: TreeNode | None = node
    while cur is not None and cur.parent is not None:
        parts = cur.value.tolist() + parts
        cur = cur.parent
    return parts


# ---- basic tree operations -----------------------------------------------------


def test_insert_and_match() -> None:
    _, alloc, c = make()
    v = slots(alloc, 3)
    assert c.insert([1, 2, 3], v) == 0
    m = c.match_prefix([1, 2, 3, 4])
    assert m.kv_indices.tolist() == v.tolist() and m.kv_indices.dtype == torch.int64
    assert c.match_prefix([9]).kv_indices.numel() == 0
    assert c.match_prefix([9]).last_node is c.root
    assert c.match_prefix([]).kv_indices.numel() == 0
    # Re-inserting reports everything as already present.
    assert c.insert([1, 2, 3], v) == 3
    v2 = slots(alloc, 5)
    assert c.insert([1, 2, 3, 4, 5], v2) == 3
    assert c.match_prefix([1, 2, 3, 4, 5]).kv_indices.tolist() == v.tolist() + v2[3:].tolist()
    assert c.total_size() == 5


def test_insert_value_is_copied() -> None:
    pool, alloc, c = make()
    v = slots(alloc, 4)
    pool.req_to_token[0, :4] = v
    c.insert([1, 2, 3, 4], pool.req_to_token[0, :4])
    pool.req_to_token[0, :4] = -7  # row reused by another request
    assert c.match_prefix([1, 2, 3, 4]).kv_indices.tolist() == v.tolist()


def test_split_in_middle_preserves_values() -> None:
    _, alloc, c = make()
    v = slots(alloc, 5)
    c.insert([1, 2, 3, 4, 5], v)
    m = c.match_prefix([1, 2, 3])
    assert m.kv_indices.tolist() == v[:3].tolist()
    assert m.last_node.key == [1, 2, 3]
    (child,) = m.last_node.children.values()
    assert child.key == [4, 5] and child.value.tolist() == v[3:].tolist()
    assert c.match_prefix([1, 2, 3, 4, 5]).kv_indices.tolist() == v.tolist()
    assert c.total_size() == 5 and c.evictable_size() == 5


def test_divergent_match_and_insert() -> None:
    _, alloc, c = make()
    v = slots(alloc, 4)
    c.insert([1, 2, 3, 4], v)
    m = c.match_prefix([1, 2, 9, 9])
    assert m.kv_indices.tolist() == v[:2].tolist()
    assert m.last_node.key == [1, 2] and len(m.last_node.children) == 1
    w = slots(alloc, 4)
    assert c.insert([1, 2, 9, 9], w) == 2
    assert len(m.last_node.children) == 2
    assert c.match_prefix([1, 2, 9, 9]).kv_indices.tolist() == v[:2].tolist() + w[2:].tolist()
    assert c.total_size() == 6


def test_lock_moves_between_evictable_and_protected() -> None:
    _, alloc, c = make()
    c.insert([1, 2, 3, 4], slots(alloc, 4))
    c.insert([1, 2, 7], slots(alloc, 3))  # splits into [1,2] -> {[3,4], [7]}
    assert c.evictable_size() == 5 and c.protected_size() == 0
    m = c.match_prefix([1, 2, 3, 4])
    c.inc_lock_ref(m.last_node)
    assert c.protected_size() == 4 and c.evictable_size() == 1
    c.inc_lock_ref(m.last_node)
    assert c.protected_size() == 4
    c.dec_lock_ref(m.last_node)
    assert c.protected_size() == 4
    c.dec_lock_ref(m.last_node)
    assert c.protected_size() == 0 and c.evictable_size() == 5
    with pytest.raises(RuntimeError):
        c.dec_lock_ref(m.last_node)


def test_split_of_locked_node_keeps_lock_accounting() -> None:
    _, alloc, c = make()
    c.insert([1, 2, 3, 4], slots(alloc, 4))
    m = c.match_prefix([1, 2, 3, 4])
    c.inc_lock_ref(m.last_node)
    c.match_prefix([1, 2])  # split a locked node
    assert c.protected_size() == 4 and c.evictable_size() == 0
    assert c.evict(100) == 0
    c.dec_lock_ref(m.last_node)
    assert c.protected_size() == 0 and c.evictable_size() == 4
    assert c.evict(100) == 4 and alloc.available_size() == alloc.total_slots


def test_locked_nodes_never_evicted() -> None:
    _, alloc, c = make()
    c.insert([1, 2, 3], slots(alloc, 3))
    c.insert([5, 6], slots(alloc, 2))
    m = c.match_prefix([1, 2, 3])
    c.inc_lock_ref(m.last_node)
    assert c.evict(100) == 2
    assert len(c.match_prefix([1, 2, 3])) == 3
    assert len(c.match_prefix([5, 6])) == 0
    assert alloc.available_size() == alloc.total_slots - 3
    c.dec_lock_ref(m.last_node)
    assert c.evict(1) == 3


def test_eviction_is_lru_over_leaves() -> None:
    _, alloc, c = make()
    va, vb, vc = slots(alloc, 2), slots(alloc, 2), slots(alloc, 2)
    c.insert([1, 1], va)
    c.insert([2, 2], vb)
    c.insert([3, 3], vc)
    c.match_prefix([1, 1])  # refresh a: b is now the oldest
    assert c.evict(1) == 2
    assert len(c.match_prefix([2, 2])) == 0
    assert len(c.match_prefix([3, 3])) == 2  # refresh c: a is now the oldest
    assert c.evict(2) == 2
    assert len(c.match_prefix([1, 1])) == 0
    assert len(c.match_prefix([3, 3])) == 2
    assert alloc.available_size() == alloc.total_slots - 2
    again = slots(alloc, alloc.available_size())
    assert set(va.tolist()) | set(vb.tolist()) <= set(again.tolist())


def test_parent_becomes_evictable_after_children() -> None:
    _, alloc, c = make()
    c.insert([1, 2, 3], slots(alloc, 3))
    dup = slots(alloc, 3)
    assert c.insert([1, 2, 4], dup) == 2  # [1,2] -> {[3], [4]}
    alloc.free(dup[:2])
    assert c.total_size() == 4
    assert c.evict(2) == 2  # both leaves, parent survives
    assert len(c.match_prefix([1, 2, 3])) == 2
    assert c.evict(1) == 2  # the parent, now a leaf
    assert c.total_size() == 0 and alloc.available_size() == alloc.total_slots
    # Within one evict call a parent that becomes a leaf is a candidate too.
    c.insert([1, 2, 3], slots(alloc, 3))
    c.insert([1, 2, 4], slots(alloc, 3))
    assert c.evict(4) == 4


def test_size_accounting_and_reset() -> None:
    rng = random.Random(0)
    _, alloc, c = make(num_slots=256)
    for _ in range(30):
        key = [rng.randrange(3) for _ in range(rng.randrange(1, 8))]
        v = slots(alloc, len(key))
        present = c.insert(key, v)
        alloc.free(v[:present])
        assert c.evictable_size() + c.protected_size() == c.total_size()
        assert alloc.available_size() + c.total_size() == alloc.total_slots
        if rng.random() < 0.3:
            c.evict(rng.randrange(1, 6))
            assert alloc.available_size() + c.total_size() == alloc.total_slots
    c.reset()
    alloc.clear()
    assert c.total_size() == c.evictable_size() == c.protected_size() == 0
    assert not c.root.children
    c.check_invariant()


# ---- page_size > 1 ---------------------------------------------------------------


def test_paged_match_truncates_and_splits_at_page_boundary() -> None:
    _, alloc, c = make(page_size=4)
    key = list(range(100, 112))
    v = slots(alloc, 12)
    with pytest.raises(ValueError):
        c.insert(key[:10], v[:10])
    assert c.insert(key, v) == 0
    assert len(c.match_prefix(key[:7])) == 4  # truncated to a page multiple
    assert c.match_prefix(key[:3]).last_node is c.root
    diverge = [*key[:6], 0, 0, 0, 0]  # mismatch inside the second page
    m = c.match_prefix(diverge)
    assert m.kv_indices.tolist() == v[:4].tolist()
    assert m.last_node.key == key[:4]
    (child,) = m.last_node.children.values()
    assert child.key == key[4:] and child.value.tolist() == v[4:].tolist()
    for n in range(13):
        assert len(c.match_prefix(key[:n])) == n - n % 4
    w = slots(alloc, 8)
    assert c.insert(diverge[:8], w) == 4
    alloc.free(w[:4])
    assert len(c.match_prefix(diverge)) == 8
    assert {len(ch.key) % 4 for ch in m.last_node.children.values()} == {0}
    assert alloc.available_size() + c.total_size() == alloc.total_slots


def test_paged_first_page_mismatch_is_no_match() -> None:
    _, alloc, c = make(page_size=4)
    c.insert([1, 2, 3, 4], slots(alloc, 4))
    assert len(c.match_prefix([1, 2, 3, 5])) == 0
    assert c.insert([1, 2, 3, 5], slots(alloc, 4)) == 0
    assert len(c.root.children) == 2


# ---- request ownership flows -----------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 4])
def test_finished_duplicates_freed(page_size: int) -> None:
    pool, alloc, c = make(page_size=page_size)
    prompt = list(range(10))
    a = start(c, pool, prompt)
    b = start(c, pool, prompt)  # both miss: duplicated KV for the same text
    assert extend(c, a, 10) is not None and extend(c, b, 10) is not None
    c.cache_finished_req(a, prompt)
    aligned = 10 - 10 % page_size
    assert c.total_size() == aligned
    assert a.req_pool_idx is None and a.kv_len == a.cached_len == 0 and a.last_node is c.root
    c.cache_finished_req(b, prompt)
    assert c.total_size() == aligned
    c.check_invariant()
    assert alloc.available_size() == alloc.total_slots - aligned


@pytest.mark.parametrize("page_size", [1, 4])
def test_chunked_flow_keeps_invariant(page_size: int) -> None:
    pool, alloc, c = make(page_size=page_size)
    prompt = list(range(50, 63))  # 13 tokens
    r = start(c, pool, prompt)
    for chunk in (5, 5, 3):
        assert extend(c, r, chunk) is not None
        c.cache_unfinished_req(r, r.tokens)
        assert r.cached_len == r.kv_len - r.kv_len % page_size
        assert c.protected_size() == r.cached_len
        assert path_value(r.last_node) == c.req_to_token_pool.req_to_token[0, : r.cached_len].tolist()
    # A second request sharing the prompt reuses the cached pages while r decodes.
    s = start(c, pool, prompt)
    assert s.cached_len == 13 - 13 % page_size
    for _ in range(6):
        assert r.req_pool_idx is not None
        row = pool.req_to_token[r.req_pool_idx]
        d = alloc.alloc_decode([r.kv_len], [int(row[r.kv_len - 1])])
        assert d is not None
        row[r.kv_len] = d[0]
        r.kv_len += 1
        r.tokens.append(7)
    for p in range(r.kv_len):
        assert int(row[p]) % page_size == p % page_size
    c.cache_finished_req(r, r.tokens)
    c.cache_finished_req(s, s.tokens)
    c.check_invariant()
    assert c.total_size() == 19 - 19 % page_size


def test_unfinished_with_duplicate_rewrites_row() -> None:
    pool, _, c = make()
    prompt = list(range(8))
    a = start(c, pool, prompt)
    b = start(c, pool, prompt)
    extend(c, a, 8)
    extend(c, b, 8)
    c.cache_finished_req(a, prompt)
    c.cache_unfinished_req(b, prompt)
    assert b.cached_len == 8
    tree = c.match_prefix(prompt).kv_indices.tolist()
    assert pool.req_to_token[b.req_pool_idx, :8].tolist() == tree
    assert c.protected_size() == 8
    c.cache_finished_req(b, prompt)
    c.check_invariant()


def test_check_invariant_reports_leaks() -> None:
    pool, alloc, c = make()
    c.check_invariant()
    r = start(c, pool, [1, 2, 3])
    extend(c, r, 3)
    c.cache_unfinished_req(r, r.tokens)
    with pytest.raises(KVLeakError, match=r"protected size 3"):
        c.check_invariant()
    c.cache_finished_req(r, r.tokens)
    c.check_invariant()
    slots(alloc, 2)
    with pytest.raises(KVLeakError, match=r"leaked 2"):
        c.check_invariant()


def test_chunk_cache_flow() -> None:
    pool, alloc, c = make(chunk=True)
    assert c.disabled
    prompt = list(range(9))
    r = start(c, pool, prompt)
    assert r.kv_len == 0 and r.last_node is c.root
    extend(c, r, 5)
    c.cache_unfinished_req(r, r.tokens)
    assert r.cached_len == 0
    extend(c, r, 4)
    assert c.insert(prompt, torch.arange(9)) == 0
    assert c.evict(10) == 0 and c.total_size() == c.evictable_size() == c.protected_size() == 0
    with pytest.raises(KVLeakError):
        c.check_invariant()
    assert alloc.available_size() == alloc.total_slots - 9
    c.cache_finished_req(r, prompt)
    assert r.req_pool_idx is None
    c.check_invariant()
    assert len(c.match_prefix(prompt)) == 0


# ---- randomized simulation ----------------------------------------------------


def _owned_pages(c: RadixCache, active: list[FakeReq]) -> tuple[set[int], set[int]]:
    ps = c.page_size
    stack = list(c.root.children.values())
    tree: list[int] = []
    while stack:
        n = stack.pop()
        tree.extend(n.value.tolist())
        stack.extend(n.children.values())
    tree_pages = {s // ps for s in tree}
    assert len(tree) == len(set(tree)) == len(tree_pages) * ps, "tree slots duplicated or partial pages"
    req_pages: set[int] = set()
    for r in active:
        assert r.req_pool_idx is not None
        row = c.req_to_token_pool.req_to_token[r.req_pool_idx]
        own = {int(s) // ps for s in row[r.cached_len : r.kv_len]}
        assert not own & req_pages, "two requests own one page"
        req_pages |= own
        assert path_value(r.last_node) == row[: r.cached_len].tolist()
        assert all(int(row[p]) % ps == p % ps for p in range(r.kv_len))
    assert not tree_pages & req_pages, "a page is owned by the tree and by a request"
    return tree_pages, req_pages


@pytest.mark.parametrize("page_size", [1, 4])
def test_randomized_simulation(page_size: int) -> None:
    rng = random.Random(1234 + page_size)
    pool, alloc, cache = make(page_size=page_size, num_slots=160, num_reqs=6)
    c = radix(cache)
    bases = [[rng.randrange(4) for _ in range(rng.randrange(4, 30))] for _ in range(4)]
    active: list[FakeReq] = []
    waiting: list[list[int]] = []
    targets: dict[int, int] = {}
    ps = page_size

    def grow(r: FakeReq, n: int) -> bool:
        assert r.req_pool_idx is not None
        _, req_pages = _owned_pages(c, active)
        prev = r.kv_len
        row = pool.req_to_token[r.req_pool_idx]
        partial = {int(row[prev - 1]) // ps} if prev % ps else set()
        new = extend(c, r, n)
        if new is None:
            c.cache_finished_req(r, r.tokens)  # retract: survivors get re-matched later
            active.remove(r)
            waiting.append(r.tokens[: rng.randrange(1, len(r.tokens) + 1)])
            return False
        # Only the request's own partial page may be reused; every other page must have been free.
        fresh = {int(s) // ps for s in new} - partial
        tree_pages, _ = _owned_pages(c, [])
        assert not fresh & (tree_pages | req_pages), "double allocation"
        return True

    for _ in range(400):
        op = rng.random()
        if op < 0.3 and pool.available_size():
            tokens = (
                waiting.pop()
                if waiting and rng.random() < 0.5
                else (list(rng.choice(bases)) + [rng.randrange(4) for _ in range(rng.randrange(0, 12))])
            )
            r = start(c, pool, tokens)
            active.append(r)
            targets[id(r)] = len(tokens) + rng.randrange(0, 10)
        elif op < 0.9 and active:
            r = rng.choice(active)
            if r.kv_len < len(r.tokens):
                n = rng.randrange(1, len(r.tokens) - r.kv_len + 1)
                if grow(r, n) and rng.random() < 0.7:
                    c.cache_unfinished_req(r, r.tokens)
            elif r.kv_len < targets[id(r)]:
                r.tokens.append(rng.randrange(4))
                grow(r, 1)
            else:
                c.cache_finished_req(r, r.tokens)
                active.remove(r)
        elif active:
            r = rng.choice(active)
            c.cache_finished_req(r, r.tokens)
            active.remove(r)
            waiting.append(r.tokens)
        tree_pages, req_pages = _owned_pages(c, active)
        assert c.evictable_size() + c.protected_size() == c.total_size() == len(tree_pages) * ps
        # Request-owned pages count whole, including the unused tail of a partial page.
        assert alloc.available_size() + ps * (len(tree_pages) + len(req_pages)) == alloc.total_slots
    for r in list(active):
        c.cache_finished_req(r, r.tokens)
    c.check_invariant()
    assert c.total_size() > 0
    c.evict(alloc.total_slots)
    assert alloc.available_size() == alloc.total_slots and c.total_size() == 0


def _reference_victims(c: RadixCache, num_tokens: int) -> list[int]:
    """The nodes evict should take, found the slow way: every evictable leaf of the whole tree,
    least recently used first, a parent joining once its last child goes."""
    leaves = [n for n in c._iter_nodes() if n.is_leaf and n.lock_ref == 0]
    heap = [(n.last_access_time, n.node_id, n) for n in leaves]
    heapq.heapify(heap)
    children = {id(n): len(n.children) for n in [c.root, *c._iter_nodes()]}
    taken, freed = [], 0
    while heap and freed < num_tokens:
        _, _, node = heapq.heappop(heap)
        taken.append(node.node_id)
        freed += len(node.key)
        parent = node.parent
        assert parent is not None
        children[id(parent)] -= 1
        if parent is not c.root and children[id(parent)] == 0 and parent.lock_ref == 0:
            heapq.heappush(heap, (parent.last_access_time, parent.node_id, parent))
    return taken


@pytest.mark.parametrize("seed", range(6))
def test_evictions_kept_between_calls_take_what_a_walk_of_the_whole_tree_would(seed: int) -> None:
    # The eviction heap outlives each evict (stale entries checked when popped); a long random
    # mix of inserts, lookups, locks and evictions must evict exactly the reference's nodes.
    rng = random.Random(seed)
    _, alloc, cache = make(num_slots=4096, num_reqs=1)
    assert isinstance(cache, RadixCache)
    locked: list[TreeNode] = []
    for _ in range(1500):
        op = rng.random()
        key = [rng.randrange(4) for _ in range(rng.randrange(1, 12))]
        if op < 0.4 and alloc.available_size() >= len(key):
            new = slots(alloc, len(key))
            alloc.free(new[: cache.insert(key, new)])  # the tree keeps its own copy of what it had
        elif op < 0.6:
            match = cache.match_prefix(key)
            if len(match) and rng.random() < 0.5:
                cache.inc_lock_ref(match.last_node)
                locked.append(match.last_node)
        elif op < 0.75 and locked:
            cache.dec_lock_ref(locked.pop(rng.randrange(len(locked))))
        else:
            want = rng.randrange(1, 10)
            expected = _reference_victims(cache, want)
            before = {n.node_id for n in cache._iter_nodes()}
            cache.evict(want)
            gone = before - {n.node_id for n in cache._iter_nodes()}
            assert gone == set(expected)
    for node in locked:
        cache.dec_lock_ref(node)
    cache.check_invariant()
    cache.evict(cache.evictable_size())
    assert alloc.available_size() == alloc.total_slots
