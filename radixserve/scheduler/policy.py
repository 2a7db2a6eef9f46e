"""Which waiting requests prefill next: the queue order (SchedulePolicy) and the budget (PrefillAdder)."""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass, field
from enum import Enum
from operator import attrgetter

from radixserve.cache.radix_cache import PrefixCache, TreeNode
from radixserve.scheduler.request import Req

# A request expecting more new tokens than this is budgeted as if it expected this many: long
# max_new_tokens values are usually upper bounds, and budgeting them fully would starve admission.
CLIP_MAX_NEW_TOKENS_ESTIMATE = 4096
# Cache-aware ordering walks the radix tree per request; past this queue length it costs more
# than it saves, so the queue falls back to arrival order.
LPM_MAX_QUEUE = 128
# Two waiting requests that share at least this many leading tokens are "the same prefix": only the
# first is prefilled this round, the others wait one round and then reuse its cached KV.
IN_BATCH_PREFIX_TOKENS = 32


_ARRIVAL = attrgetter("arrival")


@dataclass(frozen=True)
class PriorityRule:
    """--enable-priority-scheduling: requests' `priority` values, ranked as SGLang ranks them (a
    higher value first, unless --schedule-low-priority-values-first)."""

    low_values_first: bool = False
    # A waiting request may preempt a running one only when it outranks it by more than this.
    preemption_threshold: int = 10

    def rank(self, req: Req) -> int:
        """Sorts ascending: the request to serve first has the lowest rank."""
        return req.priority if self.low_values_first else -req.priority

    def may_preempt(self, req: Req, running: Req) -> bool:
        return self.rank(running) - self.rank(req) > self.preemption_threshold

    def victims(self, req: Req, running: list[Req]) -> list[Req]:
        """The running requests `req` may preempt, in the order to take them: the lowest-ranked
        first, and among equals the one with the fewest outputs (the least work to redo)."""
        outranked = [r for r in running if self.may_preempt(req, r)]
        return sorted(outranked, key=lambda r: (-self.rank(r), len(r.output_ids), -r.arrival))


class SchedulePolicy:
    def __init__(
        self, policy: str, tree_cache: PrefixCache, seed: int = 0, priority: PriorityRule | None = None
    ):
        self.policy = policy
        self.tree_cache = tree_cache
        self.rng = random.Random(seed)
        # None: priorities are not looked at (SGLang ignores them unless enabled).
        self.priority = priority

    @property
    def cache_aware(self) -> bool:
        return self.policy in ("lpm", "dfs-weight") and not self.tree_cache.disabled

    def order(self, queue: list[Req]) -> list[Req]:
        """Returns the requests the prefill adder should try this round, in order: by priority
        first when priorities are on, then by the policy.

        Cache-aware policies leave out requests whose prefix another request of this round will
        compute: they stay queued and reuse its KV next round.
        """
        ordered = self._policy_order(queue)
        if self.priority is None:
            return ordered
        return sorted(ordered, key=self.priority.rank)  # stable: the policy orders each priority

    def _policy_order(self, queue: list[Req]) -> list[Req]:
        policy = self.policy
        if policy in ("lpm", "dfs-weight") and (not self.cache_aware or len(queue) > LPM_MAX_QUEUE):
            policy = "fcfs"
        if policy == "fcfs":
            return sorted(queue, key=_ARRIVAL)
        if policy == "lof":
            return sorted(queue, key=lambda r: (-r.sampling_params.max_new_tokens, r.arrival))
        if policy == "random":
            shuffled = list(queue)
            self.rng.shuffle(shuffled)
            return shuffled
        matched = {id(r): self.tree_cache.match_prefix(r.prefix_match_ids()) for r in queue}
        if policy == "lpm":
            ordered = sorted(queue, key=lambda r: (-len(matched[id(r)].kv_indices), r.arrival))
        else:
            ordered = self._dfs_weight_order(queue, {id(r): matched[id(r)].last_node for r in queue})
        return _without_shared_prefixes(ordered, {id(r): len(matched[id(r)].kv_indices) for r in queue})

    def _dfs_weight_order(self, queue: list[Req], nodes: dict[int, TreeNode]) -> list[Req]:
        # Weight every tree node by the number of waiting requests below it, then walk the tree
        # heaviest branch first: requests sharing the most cached context run back to back.
        by_node: dict[int, list[Req]] = defaultdict(list)
        weight: dict[int, int] = defaultdict(int)
        for req in queue:
            node: TreeNode | None = nodes[id(req)]
            by_node[id(node)].append(req)
            while node is not None:
                weight[id(node)] += 1
                node = node.parent
        ordered: list[Req] = []
        stack: list[TreeNode] = [self.tree_cache.root]
        while stack:
            node = stack.pop()
            ordered.extend(sorted(by_node.get(id(node), []), key=lambda r: r.arrival))
            children = [c for c in node.children.values() if weight.get(id(c), 0) > 0]
            stack.extend(sorted(children, key=lambda c: weight[id(c)]))
        return ordered


def _without_shared_prefixes(ordered: list[Req], cached_lens: dict[int, int]) -> list[Req]:
    """In-batch prefix deduplication: of the requests that share an uncached prefix, only the
    first is a candidate this round."""
    seen: set[tuple[int, ...]] = set()
    candidates: list[Req] = []
    for req in ordered:
        ids = req.origin_input_ids
        if cached_lens[id(req)] < IN_BATCH_PREFIX_TOKENS and len(ids) > IN_BATCH_PREFIX_TOKENS:
            head = tuple(ids[:IN_BATCH_PREFIX_TOKENS])
            if head in seen:
                continue
            seen.add(head)
        candidates.append(req)
    return candidates


class AddResult(Enum):
    CONTINUE = "continue"  # added; try the next request
    NO_TOKEN = "no_token"  # the KV budget is spent
    OTHER = "other"  # another limit (prefill tokens, one chunk at a time) is reached


@dataclass
class PrefillAdder:
    """Admits requests into one prefill batch while the budgets allow.

    KV budget = free + evictable slots − what running requests are still expected to need
    (remaining new tokens × new_token_ratio) − what the requests admitted so far need.
    """

    tree_cache: PrefixCache
    available_slots: int
    running_reserved: float
    max_prefill_tokens: int
    chunk_budget: int | None
    page_size: int
    can_run: list[Req] = field(default_factory=list)
    new_chunked_req: Req | None = None
    consumed: float = 0.0
    prefill_tokens: int = 0
    cached_tokens: int = 0

    def remaining_kv(self) -> float:
        return self.available_slots + self.tree_cache.evictable_size() - self.running_reserved - self.consumed

    def add_chunked_req(self, req: Req) -> Req | None:
        """Schedules the next chunk of the request being prefilled in pieces; returns it if more remain."""
        remaining = req.seq_len - req.kv_len
        budget = int(min(self.remaining_kv(), self.chunk_budget or remaining))
        size = min(remaining, budget)
        if size < remaining:
            size = size // self.page_size * self.page_size
        if size <= 0:
            return req
        req.extend_len = size
        self.can_run.append(req)
        self.consumed += size
        self.prefill_tokens += size
        if self.chunk_budget is not None:
            self.chunk_budget -= size
        return req if size < remaining else None

    def kv_shortfall(self, req: Req) -> float:
        """How many more KV slots than the budget holds `req` needs to be admitted (<= 0: none)."""
        match = self.tree_cache.match_prefix(req.prefix_match_ids())
        needed = (
            req.seq_len - len(match.kv_indices) + min(req.remaining_new_tokens, CLIP_MAX_NEW_TOKENS_ESTIMATE)
        )
        return needed - (self.remaining_kv() - _unlocked_path_size(match.last_node))

    def add_one_req(self, req: Req, has_chunked_req: bool) -> AddResult:
        match = self.tree_cache.match_prefix(req.prefix_match_ids())
        prefix_len = len(match.kv_indices)
        extend_len = req.seq_len - prefix_len
        expected_new = min(req.remaining_new_tokens, CLIP_MAX_NEW_TOKENS_ESTIMATE)
        if extend_len + expected_new > self.remaining_kv() - _unlocked_path_size(match.last_node):
            return AddResult.NO_TOKEN
        if self.can_run and self.prefill_tokens + extend_len > self.max_prefill_tokens:
            return AddResult.OTHER

        chunked = self.chunk_budget is not None and extend_len > self.chunk_budget
        if chunked:
            if has_chunked_req or self.new_chunked_req is not None:
                return AddResult.OTHER
            assert self.chunk_budget is not None
            extend_len = self.chunk_budget // self.page_size * self.page_size
            if extend_len <= 0:
                return AddResult.OTHER

        # Lock the prefix now so allocation for this batch cannot evict it.
        self.tree_cache.inc_lock_ref(match.last_node)
        if prefix_len:
            node: TreeNode | None = match.last_node
            while node is not None:
                node.hits += 1
                node = node.parent
        req.prefix_slots = match.kv_indices
        req.prefix_node = match.last_node
        req.extend_len = extend_len
        self.can_run.append(req)
        self.consumed += extend_len + (0 if chunked else expected_new)
        self.prefill_tokens += extend_len
        self.cached_tokens += prefix_len
        if self.chunk_budget is not None:
            self.chunk_budget -= extend_len
        if chunked:
            self.new_chunked_req = req
            return AddResult.OTHER
        return AddResult.CONTINUE


def _unlocked_path_size(node: TreeNode | None) -> int:
    """Slots on the path to `node` that count as evictable now but stop being so once locked."""
    size = 0
    while node is not None:
        if node.lock_ref == 0:
            size += len(node.key)
        node = node.parent
    return size
