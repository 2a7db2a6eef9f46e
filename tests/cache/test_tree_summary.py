"""The dashboard's radix tree summary (cache/tree_summary.py): subtree sizes, the largest
children first and bounded, hits carried through node splits."""

from __future__ import annotations

import torch

from radixserve.cache.pools import KVSlotAllocator, ReqToTokenPool
from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.tree_summary import PREVIEW_IDS, summarize_tree


def test_sizes_order_bounds_and_hits() -> None:
    cache = RadixCache(ReqToTokenPool(4, 128), KVSlotAllocator(512, 1), 1)
    shared = list(range(100, 130))
    for i, tail_len in enumerate([5, 20, 10]):
        key = shared + [200 + 10 * i + j for j in range(tail_len)]
        cache.insert(key, torch.arange(len(key)))
    long_chain = list(range(300, 310))
    cache.insert(long_chain, torch.arange(10))
    # A hit on the shared prefix, then a split inside it: the new upper node keeps the hits.
    node = cache.match_prefix(shared).last_node
    walk = node
    while walk is not None:
        walk.hits += 1
        walk = walk.parent
    cache.insert(shared[:12] + [999], torch.arange(13))

    tree = summarize_tree(cache.root, max_children=2, max_depth=3)
    assert tree["total_tokens"] == 30 + 35 + 10 + 1 and tree["hits"] == 1
    first, second = tree["children"]  # the larger subtree first; both shown
    assert first["total_tokens"] == 30 + 35 + 1 and first["tokens"] == 12 and first["hits"] == 1
    assert first["ids"] == shared[:PREVIEW_IDS]
    assert second["total_tokens"] == 10
    below = first["children"]
    assert len(below) == 2 and below[0]["total_tokens"] == 18 + 35  # max_children bounds the rest
    tails = below[0]["children"]
    assert [t["tokens"] for t in tails] == [20, 10]  # the 5-token tail is left out
    assert all(t["children"] == [] for t in tails)  # max_depth
