"""The n-gram index NGRAM speculation drafts from: what followed each recent n-gram.

Every request's prompt and output go into one index shared by all requests, so a request can draft
from its own text (a passage it is asked to repeat, code it edits) and from text served recently
(the same system prompt or document asked about again). For each window size n between the
minimum and maximum match window, the index maps the n tokens before a position to counts of the
token found there.

Drafting (`propose`) grows a tree from a request's context: the children of a node are the tokens
that most often followed the longest window ending at that node, so deeper windows (more specific
matches) are preferred over short ones. BFS fills the tree level by level (the widest levels
first); PROB grows it best-first by the estimated probability of reaching each node.

Bounded: two generations of entries. New entries go to the young one; when it holds half the
capacity it becomes the old one (the previous old one is dropped), and an entry read from the old
generation moves back to the young one. So the index keeps roughly the `capacity` most recently
used n-grams, at O(1) per operation.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from radixserve.forward.draft_tree import DraftTree

# Continuations kept per n-gram: drafting never uses more than the widest breadth, and the ones
# seen most often are the ones kept.
MAX_CONTINUATIONS = 8


@dataclass(frozen=True)
class NgramConfig:
    min_window: int = 1
    max_window: int = 12
    min_breadth: int = 1
    max_breadth: int = 10
    match_type: str = "BFS"  # or "PROB"
    max_depth: int = 18
    capacity: int = 1_000_000


class NgramIndex:
    def __init__(self, config: NgramConfig):
        if not 1 <= config.min_window <= config.max_window:
            raise ValueError("the n-gram match windows need 1 <= min <= max")
        self.config = config
        self._young: dict[tuple[int, ...], dict[int, int]] = {}
        self._old: dict[tuple[int, ...], dict[int, int]] = {}

    def __len__(self) -> int:
        return len(self._young) + len(self._old)

    def add(self, tokens: list[int], start: int) -> None:
        """Records what follows every window in tokens that ends at a position >= start (the
        caller passes the whole sequence and how much of it was added before)."""
        low, high = self.config.min_window, self.config.max_window
        for end in range(max(start, 1), len(tokens)):
            following = tokens[end]
            for n in range(low, min(high, end) + 1):
                counts = self._entry(tuple(tokens[end - n : end]), create=True)
                assert counts is not None
                counts[following] = counts.get(following, 0) + 1
                if len(counts) > MAX_CONTINUATIONS:
                    del counts[min(counts, key=counts.__getitem__)]

    def continuations(self, context: list[int]) -> list[tuple[int, float]]:
        """The tokens seen after the longest window of context's end that the index holds, most
        frequent first, with their share of that window's count."""
        low, high = self.config.min_window, self.config.max_window
        for n in range(min(high, len(context)), low - 1, -1):
            counts = self._entry(tuple(context[-n:]), create=False)
            if counts:
                total = sum(counts.values())
                ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
                return [(token, count / total) for token, count in ranked]
        return []

    def propose(
        self, context: list[int], budget: int, max_depth: int, odds: float = 1.0, min_reach: float = 0.0
    ) -> DraftTree:
        """A draft tree of at most budget nodes (the root, context's last token, included) and at
        most max_depth levels below the root (nor more than the configured depth). A node's reach,
        its estimated chance of being emitted, is its parent's times `odds` (the chance a draft is
        accepted given its parent was) times its share of the parent's continuations; nodes whose
        reach is below min_reach are left out."""
        depth = min(max_depth, self.config.max_depth)
        if budget <= 1 or depth < 1:
            return DraftTree([context[-1]], [-1])
        # Only the last max_window tokens can match.
        context = context[-self.config.max_window :]
        if self.config.match_type == "PROB":
            return self._best_first(context, budget, depth, odds, min_reach)
        return self._breadth_first(context, budget, depth, odds, min_reach)

    def _breadth_first(
        self, context: list[int], budget: int, max_depth: int, odds: float, min_reach: float
    ) -> DraftTree:
        cfg = self.config
        tokens, parents = [context[-1]], [-1]
        level = [(0, context, 1.0)]
        depth = 0
        while level and len(tokens) < budget and depth < max_depth:
            # Breadth narrows with depth: from max_breadth at the first level to min_breadth.
            breadth = max(cfg.min_breadth, cfg.max_breadth >> depth)
            next_level = []
            for node, node_context, reach in level:
                for token, share in self.continuations(node_context)[:breadth]:
                    child_reach = reach * odds * share
                    if len(tokens) >= budget or child_reach < min_reach:
                        break
                    tokens.append(token)
                    parents.append(node)
                    next_level.append(
                        (len(tokens) - 1, [*node_context, token][-cfg.max_window :], child_reach)
                    )
            level, depth = next_level, depth + 1
        return DraftTree(tokens, parents)

    def _best_first(
        self, context: list[int], budget: int, max_depth: int, odds: float, min_reach: float
    ) -> DraftTree:
        cfg = self.config
        tokens, parents, depths = [context[-1]], [-1], [0]
        contexts = [context]
        # (-probability of reaching the candidate, tie-break order, parent, token)
        frontier: list[tuple[float, int, int, int]] = []
        order = 0

        def expand(node: int, reach: float) -> None:
            nonlocal order
            if depths[node] >= max_depth:
                return
            for token, share in self.continuations(contexts[node])[: cfg.max_breadth]:
                if reach * odds * share >= min_reach:
                    heapq.heappush(frontier, (-reach * odds * share, order, node, token))
                    order += 1

        expand(0, 1.0)
        while frontier and len(tokens) < budget:
            negative_reach, _, parent, token = heapq.heappop(frontier)
            tokens.append(token)
            parents.append(parent)
            depths.append(depths[parent] + 1)
            contexts.append([*contexts[parent], token][-cfg.max_window :])
            expand(len(tokens) - 1, -negative_reach)
        return DraftTree(tokens, parents)

    def _entry(self, key: tuple[int, ...], create: bool) -> dict[int, int] | None:
        counts = self._young.get(key)
        if counts is not None:
            return counts
        counts = self._old.pop(key, None)
        if counts is None:
            if not create:
                return None
            counts = {}
        self._young[key] = counts
        if len(self._young) >= max(1, self.config.capacity // 2):
            self._old, self._young = self._young, {}
        return counts
