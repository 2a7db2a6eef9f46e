"""Radix-tree prefix cache over KV slots, plus a no-op ``ChunkCache``.

Ownership model (the scheduler relies on it): for a running request,
positions ``[0, cached_len)`` of its ``req_to_token`` row are owned by the tree
and pinned by a lock on ``last_node``; positions ``[cached_len, kv_len)`` are
owned by the request. Every KV slot is therefore exactly one of: free in the
allocator, owned by a tree node, or owned by one request.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from radixserve.cache.block_hash import page_hashes
from radixserve.cache.kv_events import KVEventRecorder
from radixserve.cache.pools import KVSlotAllocator, ReqToTokenPool
from radixserve.cache.tiers import CacheTier, DeviceOnlyTier

__all__ = [
    "CacheableRequest",
    "ChunkCache",
    "KVLeakError",
    "MatchResult",
    "PrefixCache",
    "RadixCache",
    "TreeNode",
]

_node_ids = itertools.count()


@dataclass(eq=False)
class TreeNode:
    # Keyed by the child's first page: tuple of page_size ids, or the bare int when page_size == 1.
    children: dict[Hashable, TreeNode] = field(default_factory=dict)
    parent: TreeNode | None = None
    key: list[int] = field(default_factory=list)
    value: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    # One hash per page of key (cache/block_hash.py), kept only while KV events are recorded.
    hashes: list[int] = field(default_factory=list)
    # Number of locks held on this node or any descendant (locks are taken on a path to the root).
    lock_ref: int = 0
    # Logical clock, not wall time, so eviction order is deterministic.
    last_access_time: int = 0
    # Requests admitted with a cached prefix through this node (the dashboard's tree view).
    hits: int = 0
    node_id: int = field(default_factory=lambda: next(_node_ids))

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def __repr__(self) -> str:
        return (
            f"TreeNode(id={self.node_id}, len={len(self.key)}, lock_ref={self.lock_ref}, "
            f"children={len(self.children)}, t={self.last_access_time})"
        )


@dataclass
class MatchResult:
    kv_indices: torch.Tensor
    last_node: TreeNode

    def __len__(self) -> int:
        return int(self.kv_indices.numel())


class CacheableRequest(Protocol):
    req_pool_idx: int | None
    kv_len: int
    cached_len: int
    last_node: TreeNode


class KVLeakError(RuntimeError):
    pass


class PrefixCache(ABC):
    """Interface shared by ``RadixCache`` and ``ChunkCache``."""

    page_size: int
    root: TreeNode

    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: KVSlotAllocator, page_size: int) -> None:
        if page_size != allocator.page_size:
            raise ValueError(f"page_size {page_size} != allocator page_size {allocator.page_size}")
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.page_size = page_size
        self.device = req_to_token_pool.req_to_token.device

    @property
    def disabled(self) -> bool:
        return False

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)

    def _free_slots(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self.allocator.free(slots)

    def _held_slots(self) -> torch.Tensor:
        """Every slot the cache holds."""
        return self._empty()

    def _release_req(self, req: CacheableRequest) -> None:
        if req.req_pool_idx is not None:
            self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.cached_len = 0
        req.kv_len = 0
        req.last_node = self.root

    @abstractmethod
    def match_prefix(self, key: Sequence[int]) -> MatchResult: ...

    @abstractmethod
    def insert(self, key: Sequence[int], value: torch.Tensor) -> int: ...

    @abstractmethod
    def inc_lock_ref(self, node: TreeNode) -> None: ...

    @abstractmethod
    def dec_lock_ref(self, node: TreeNode) -> None: ...

    @abstractmethod
    def evict(self, num_tokens: int) -> int: ...

    @abstractmethod
    def evictable_size(self) -> int: ...

    @abstractmethod
    def protected_size(self) -> int: ...

    @abstractmethod
    def total_size(self) -> int: ...

    @abstractmethod
    def reset(self) -> None: ...

    @abstractmethod
    def cache_finished_req(self, req: CacheableRequest, token_ids: Sequence[int]) -> None: ...

    @abstractmethod
    def cache_unfinished_req(self, req: CacheableRequest, token_ids: Sequence[int]) -> None: ...

    def check_invariant(self) -> None:
        """Raise KVLeakError unless every slot is free or evictable; call only when idle."""
        avail = self.allocator.available_size()
        evictable = self.evictable_size()
        protected = self.protected_size()
        total = self.allocator.total_slots
        req_avail = self.req_to_token_pool.available_size()
        req_size = self.req_to_token_pool.size
        problems = []
        if avail + evictable != total:
            problems.append(
                f"KV slots: available {avail} + evictable {evictable} = {avail + evictable} "
                f"!= total {total} (leaked {total - avail - evictable})"
            )
        if req_avail != req_size:
            problems.append(f"req slots: available {req_avail} != size {req_size}")
        if protected != 0:
            problems.append(f"protected size {protected} != 0 (a lock was not released)")
        window = self.allocator.window_leak(self._held_slots())
        if window is not None:
            problems.append(window)
        if problems:
            raise KVLeakError("; ".join(problems))


class RadixCache(PrefixCache):
    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        allocator: KVSlotAllocator,
        page_size: int = 1,
        tier: CacheTier | None = None,
        events: KVEventRecorder | None = None,
    ) -> None:
        super().__init__(req_to_token_pool, allocator, page_size)
        # The level below the device pool (cache/tiers.py): told of every insertion and eviction.
        self.tier = tier or DeviceOnlyTier()
        # Whether the hooks are worth their arguments (a node's whole path, on every eviction).
        self._tier_hooks = not isinstance(self.tier, DeviceOnlyTier)
        # KV cache events (cache/kv_events.py): every page stored and removed, named by its hash.
        self.events = events
        self.reset()

    def reset(self) -> None:
        if self.events is not None:
            self.events.cleared()
        self.root = TreeNode(value=self._empty())
        # The root is never evicted or counted; a permanent lock makes that explicit.
        self.root.lock_ref = 1
        self._evictable = 0
        self._protected = 0
        self._clock = 0
        # Eviction candidates, least recently used first, kept between evictions (rebuilding the
        # heap from a walk of the whole tree on every eviction cost O(tree) per prefill with a full
        # pool). Every evictable leaf (a leaf with lock_ref 0) has an entry; entries go stale (the
        # node was locked, got a child, left the tree, or was used since) and are checked when
        # popped: a used one is pushed again with its new time, which only grows.
        self._lru: list[tuple[int, int, TreeNode]] = []
        self._lru_rebuilt_at = 0

    # ---- key helpers -------------------------------------------------------

    def _child_key(self, key: Sequence[int], pos: int) -> Hashable:
        if self.page_size == 1:
            return key[pos]
        return tuple(key[pos : pos + self.page_size])

    def _match_len(self, node_key: list[int], key: list[int], pos: int) -> int:
        """Length of the common prefix of node_key and key[pos:], rounded down to a page."""
        n = len(node_key)
        if key[pos : pos + n] == node_key:
            return n
        i = 0
        for a, b in zip(node_key, key[pos : pos + n], strict=False):
            if a != b:
                break
            i += 1
        return i - i % self.page_size

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _split(self, child: TreeNode, at: int) -> TreeNode:
        """Split ``child`` so that its first ``at`` tokens become a new parent node."""
        parent = child.parent
        assert parent is not None and 0 < at < len(child.key)
        first = self._child_key(child.key, 0)
        # The new node sits on every path through child, so it inherits child's lock count.
        mid = TreeNode(
            parent=parent,
            key=child.key[:at],
            value=child.value[:at],
            lock_ref=child.lock_ref,
            last_access_time=child.last_access_time,
            hits=child.hits,
            hashes=child.hashes[: at // self.page_size],
        )
        child.key = child.key[at:]
        child.value = child.value[at:]
        child.hashes = child.hashes[at // self.page_size :]
        child.parent = mid
        mid.children[self._child_key(child.key, 0)] = child
        parent.children[first] = mid
        return mid

    # ---- public API --------------------------------------------------------

    def match_prefix(self, key: Sequence[int]) -> MatchResult:
        match = self._match(key)
        # Where the sliding layers' K/V of some positions was released, a request can continue
        # from an earlier length only (cache/swa_pool.py).
        usable = self.allocator.reusable_prefix_len(match.kv_indices)
        return match if usable == len(match) else self._match(key[:usable])

    def _match(self, key: Sequence[int]) -> MatchResult:
        keys = list(key[: len(key) - len(key) % self.page_size])
        now = self._tick()
        node = self.root
        node.last_access_time = now
        values: list[torch.Tensor] = []
        pos = 0
        while pos < len(keys):
            child = node.children.get(self._child_key(keys, pos))
            if child is None:
                break
            child.last_access_time = now
            m = self._match_len(child.key, keys, pos)
            if m < len(child.key):
                # Split so the returned node ends exactly at the match and can be locked on its own.
                node = self._split(child, m)
                values.append(node.value)
                break
            values.append(child.value)
            node = child
            pos += m
        kv = torch.cat(values) if values else self._empty()
        return MatchResult(kv_indices=kv, last_node=node)

    def _insert(self, key: Sequence[int], value: torch.Tensor) -> tuple[int, TreeNode]:
        if len(key) != len(value):
            raise ValueError(f"key length {len(key)} != value length {len(value)}")
        if len(key) % self.page_size:
            raise ValueError(f"key length {len(key)} is not a multiple of page_size {self.page_size}")
        keys = list(key)
        now = self._tick()
        node = self.root
        node.last_access_time = now
        pos = 0
        while pos < len(keys):
            ck = self._child_key(keys, pos)
            child = node.children.get(ck)
            if child is None:
                # Clone: callers pass views of a req_to_token row, which is reused after the request ends.
                leaf = TreeNode(parent=node, key=keys[pos:], value=value[pos:].clone(), last_access_time=now)
                node.children[ck] = leaf
                self._push_lru(leaf)
                if self.events is not None:
                    parent_hash = node.hashes[-1] if node.hashes else None
                    leaf.hashes = page_hashes(parent_hash, leaf.key, self.page_size)
                    self.events.stored(leaf.hashes, parent_hash, leaf.key)
                self._evictable += len(leaf.key)
                if self._tier_hooks:
                    self.tier.on_insert(keys, value, pos)
                return pos, leaf
            child.last_access_time = now
            m = self._match_len(child.key, keys, pos)
            if m < len(child.key):
                child = self._split(child, m)
            node = child
            pos += m
        return pos, node

    def insert(self, key: Sequence[int], value: torch.Tensor) -> int:
        return self._insert(key, value)[0]

    def inc_lock_ref(self, node: TreeNode) -> None:
        cur: TreeNode | None = node
        while cur is not None and cur is not self.root:
            if cur.lock_ref == 0:
                self._evictable -= len(cur.key)
                self._protected += len(cur.key)
            cur.lock_ref += 1
            cur = cur.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        cur: TreeNode | None = node
        while cur is not None and cur is not self.root:
            if cur.lock_ref <= 0:
                raise RuntimeError(f"dec_lock_ref on unlocked node {cur!r}")
            cur.lock_ref -= 1
            if cur.lock_ref == 0:
                self._protected -= len(cur.key)
                self._evictable += len(cur.key)
                if cur.is_leaf:
                    self._push_lru(cur)
            cur = cur.parent

    def _iter_nodes(self) -> list[TreeNode]:
        out: list[TreeNode] = []
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def _evictable_leaves(self) -> list[TreeNode]:
        return [n for n in self._iter_nodes() if n.is_leaf and n.lock_ref == 0]

    def _push_lru(self, node: TreeNode) -> None:
        heapq.heappush(self._lru, (node.last_access_time, node.node_id, node))
        # Stale entries pile up with every lock and use; past twice the live ones (at the last
        # rebuild), one walk of the tree drops them all.
        if len(self._lru) > max(4096, 2 * self._lru_rebuilt_at):
            self._lru = [(n.last_access_time, n.node_id, n) for n in self._evictable_leaves()]
            heapq.heapify(self._lru)
            self._lru_rebuilt_at = len(self._lru)

    def evict(self, num_tokens: int) -> int:
        if num_tokens <= 0:
            return 0
        heap = self._lru
        freed = 0
        to_free: list[torch.Tensor] = []
        while heap and freed < num_tokens:
            used, _, node = heapq.heappop(heap)
            parent = node.parent
            if parent is None or not node.is_leaf or node.lock_ref:
                continue  # evicted already, or not an evictable leaf now (it has its entry then)
            if used != node.last_access_time:
                heapq.heappush(heap, (node.last_access_time, node.node_id, node))
                continue
            if self._tier_hooks:
                path = self._path_key(node)
                self.tier.on_evict(path, self._path_value(node), len(path) - len(node.key))
            if self.events is not None:
                self.events.removed(node.hashes)
            to_free.append(node.value)
            del parent.children[self._child_key(node.key, 0)]
            node.parent = None
            freed += len(node.key)
            self._evictable -= len(node.key)
            if parent is not self.root and parent.is_leaf and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access_time, parent.node_id, parent))
        if to_free:
            self.allocator.free(torch.cat(to_free))
        return freed

    def check_invariant(self) -> None:
        super().check_invariant()
        queued = {id(node) for _, _, node in self._lru}
        missing = [n for n in self._evictable_leaves() if id(n) not in queued]
        if missing:
            raise KVLeakError(f"{len(missing)} evictable leaves not among the eviction candidates")

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        # Recomputed from the tree so it cross-checks the incremental counters.
        return sum(len(n.key) for n in self._iter_nodes())

    def _held_slots(self) -> torch.Tensor:
        values = [n.value for n in self._iter_nodes()]
        return torch.cat(values) if values else self._empty()

    def _path_key(self, node: TreeNode) -> list[int]:
        """The tokens from the root to the end of node."""
        parts: list[list[int]] = []
        cur: TreeNode | None = node
        while cur is not None and cur is not self.root:
            parts.append(cur.key)
            cur = cur.parent
        return [token for part in reversed(parts) for token in part]

    def _path_value(self, node: TreeNode) -> torch.Tensor:
        parts: list[torch.Tensor] = []
        cur: TreeNode | None = node
        while cur is not None and cur is not self.root:
            parts.append(cur.value)
            cur = cur.parent
        return torch.cat(parts[::-1]) if parts else self._empty()

    def cache_finished_req(self, req: CacheableRequest, token_ids: Sequence[int]) -> None:
        idx = req.req_pool_idx
        if idx is None:
            self.dec_lock_ref(req.last_node)
            self._release_req(req)
            return
        kv_len, cached_len = req.kv_len, req.cached_len
        if len(token_ids) < kv_len:
            raise ValueError(f"token_ids has {len(token_ids)} tokens, fewer than kv_len {kv_len}")
        aligned = kv_len - kv_len % self.page_size
        row = self.req_to_token_pool.req_to_token[idx]
        present, last = self._insert(token_ids[:aligned], row[:aligned])
        # Slots for tokens the tree already had (e.g. another request inserted the same
        # text meanwhile) are duplicates; the tree keeps its own copy.
        if present > cached_len and self.allocator.window is not None:
            # The tree's copies may have released the window K/V the request's duplicates hold.
            self.allocator.adopt_window(self._path_value(last)[cached_len:present], row[cached_len:present])
        self._free_slots(row[cached_len:present])
        self._free_slots(row[aligned:kv_len])
        self.dec_lock_ref(req.last_node)
        self._release_req(req)
        self._trim_windows()

    def cache_unfinished_req(self, req: CacheableRequest, token_ids: Sequence[int]) -> None:
        idx = req.req_pool_idx
        if idx is None:
            raise ValueError("cache_unfinished_req on a request without a req_pool_idx")
        kv_len, cached_len = req.kv_len, req.cached_len
        if len(token_ids) < kv_len:
            raise ValueError(f"token_ids has {len(token_ids)} tokens, fewer than kv_len {kv_len}")
        aligned = kv_len - kv_len % self.page_size
        if aligned <= cached_len:
            return
        row = self.req_to_token_pool.req_to_token[idx]
        present, new_last = self._insert(token_ids[:aligned], row[:aligned])
        if present > cached_len:
            kept = self._path_value(new_last)[cached_len:present]
            # The tree's copies may have released the window K/V this request still reads.
            self.allocator.adopt_window(kept, row[cached_len:present])
            self._free_slots(row[cached_len:present].clone())
            # Point the row at the tree's copies so attention reads the KV that survives.
            row[cached_len:present] = kept
        self.inc_lock_ref(new_last)
        self.dec_lock_ref(req.last_node)
        req.last_node = new_last
        req.cached_len = aligned
        self._trim_windows()

    def _trim_windows(self) -> None:
        """Over the window budget (cache/swa_pool.py), the window K/V of the least recently used
        unlocked nodes goes back, down to the allocator's margin below the budget. Such a node keeps
        its full layers' K/V, and a request continues from it only where its last window is alive
        (reusable_prefix_len). A locked node is on a running request's path, which may read it."""
        excess = self.allocator.window_excess()
        if excess <= 0 or self._evictable == 0:
            return  # within the budget, or every node is on a running request's path
        unlocked = [n for n in self._iter_nodes() if n.lock_ref == 0]
        unlocked.sort(key=lambda n: (n.last_access_time, n.node_id))
        for node in unlocked:
            excess -= self.allocator.release_window(node.value)
            if excess <= 0:
                return


class ChunkCache(PrefixCache):
    """Caches nothing: every slot stays request-owned until the request ends."""

    def __init__(
        self, req_to_token_pool: ReqToTokenPool, allocator: KVSlotAllocator, page_size: int = 1
    ) -> None:
        super().__init__(req_to_token_pool, allocator, page_size)
        self.reset()

    @property
    def disabled(self) -> bool:
        return True

    def reset(self) -> None:
        self.root = TreeNode(value=self._empty())
        self.root.lock_ref = 1

    def match_prefix(self, key: Sequence[int]) -> MatchResult:
        return MatchResult(kv_indices=self._empty(), last_node=self.root)

    def insert(self, key: Sequence[int], value: torch.Tensor) -> int:
        return 0

    def inc_lock_ref(self, node: TreeNode) -> None:
        pass

    def dec_lock_ref(self, node: TreeNode) -> None:
        pass

    def evict(self, num_tokens: int) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return 0

    def cache_finished_req(self, req: CacheableRequest, token_ids: Sequence[int]) -> None:
        if req.req_pool_idx is not None:
            row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
            self._free_slots(row[: req.kv_len])
        self._release_req(req)

    def cache_unfinished_req(self, req: CacheableRequest, token_ids: Sequence[int]) -> None:
        pass
