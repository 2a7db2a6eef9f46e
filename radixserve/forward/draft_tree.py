"""DraftTree: the tokens a speculative decoding step proposes for one request, as a tree.

Node 0 is the request's last sampled token (the root: its K/V is computed in the verify step like
a decode step's input); every other node is a proposed next token after its parent. A chain (each
node the child of the one before) is the common case and verifies with plain causal attention; a
tree lets one verify step check several guesses at once, each node seeing only its ancestors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class DraftTree:
    # tokens[i] is node i's token; parents[i] the index of node i's parent (-1 for the root).
    # Parents come before their children, so a node's index is at least its depth.
    tokens: list[int]
    parents: list[int]
    depths: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.tokens or len(self.tokens) != len(self.parents) or self.parents[0] != -1:
            raise ValueError("a draft tree is a root (parent -1) and nodes whose parents precede them")
        depths = [0]
        for index, parent in enumerate(self.parents[1:], start=1):
            if not 0 <= parent < index:
                raise ValueError(f"node {index}'s parent {parent} does not precede it")
            depths.append(depths[parent] + 1)
        object.__setattr__(self, "depths", depths)

    @classmethod
    def chain(cls, root: int, drafts: list[int]) -> DraftTree:
        return cls([root, *drafts], list(range(-1, len(drafts))))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return all(parent == index - 1 for index, parent in enumerate(self.parents))

    @property
    def depth(self) -> int:
        return max(self.depths)

    def children(self) -> list[dict[int, int]]:
        """Per node, its children by token (the first child with a given token wins)."""
        found: list[dict[int, int]] = [{} for _ in self.tokens]
        for index in range(1, len(self.tokens)):
            found[self.parents[index]].setdefault(self.tokens[index], index)
        return found

    def path_tokens(self, node: int) -> list[int]:
        """The proposed tokens from the root (excluded) down to node (included)."""
        path = []
        while node > 0:
            path.append(self.tokens[node])
            node = self.parents[node]
        return path[::-1]

    def visibility(self) -> torch.Tensor:
        """[n, n] bool: True where node i sees node j (j is i or one of its ancestors)."""
        n = len(self.tokens)
        seen = torch.zeros(n, n, dtype=torch.bool)
        for index in range(n):
            node = index
            while node >= 0:
                seen[index, node] = True
                node = self.parents[node]
        return seen
