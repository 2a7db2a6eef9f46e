"""A bounded summary of the radix tree for the dashboard: the largest subtrees, a few levels deep,
each node with its own edge length, its subtree's tokens, its hits, and the first ids of its edge
(the engine decodes them into a preview)."""

from __future__ import annotations

from typing import Any

from radixserve.cache.radix_cache import TreeNode

PREVIEW_IDS = 12


def summarize_tree(root: TreeNode, max_children: int = 8, max_depth: int = 4) -> dict[str, Any]:
    sizes: dict[int, int] = {}

    def subtree(node: TreeNode) -> int:
        # Iterative post-order: a long chain of single-child nodes must not hit the recursion limit.
        stack: list[tuple[TreeNode, bool]] = [(node, False)]
        while stack:
            current, expanded = stack.pop()
            if expanded:
                sizes[current.node_id] = len(current.key) + sum(
                    sizes[c.node_id] for c in current.children.values()
                )
            else:
                stack.append((current, True))
                stack.extend((c, False) for c in current.children.values())
        return sizes[node.node_id]

    subtree(root)

    def describe(node: TreeNode, depth: int) -> dict[str, Any]:
        children = sorted(node.children.values(), key=lambda c: -sizes[c.node_id])
        return {
            "ids": [int(t) for t in node.key[:PREVIEW_IDS]],
            "tokens": len(node.key),
            "total_tokens": sizes[node.node_id],
            "hits": node.hits,
            "children": [describe(c, depth + 1) for c in children[:max_children]]
            if depth < max_depth
            else [],
        }

    return describe(root, 0)
