"""The n-gram index NGRAM speculation drafts from: longest matches first, BFS and PROB trees,
budgets and depths respected, and a bounded size."""

from __future__ import annotations

import pytest

from radixserve.scheduler.speculative.ngram import MAX_CONTINUATIONS, NgramConfig, NgramIndex


def _index(**config: object) -> NgramIndex:
    return NgramIndex(NgramConfig(**config))  # type: ignore[arg-type]


def test_a_passage_is_drafted_back_from_its_own_text() -> None:
    index = _index()
    passage = list(range(100, 140))
    index.add(passage, 0)
    tree = index.propose(passage[:10], budget=8, max_depth=18)
    assert tree.is_chain and tree.tokens == passage[9:17]


def test_incremental_adds_equal_one_add() -> None:
    whole, parts = _index(), _index()
    text = [5, 6, 7, 5, 6, 8, 5, 6, 7, 9]
    whole.add(text, 0)
    for end in range(1, len(text) + 1):
        parts.add(text[:end], end - 1)
    for n in range(1, len(text)):
        assert whole.continuations(text[:n]) == parts.continuations(text[:n])


def test_the_longest_window_decides_and_counts_rank() -> None:
    index = _index(max_window=3)
    index.add([1, 2, 3, 4], 0)
    index.add([9, 2, 3, 5], 0)
    index.add([9, 2, 3, 5], 0)
    # After (1, 2, 3) only 4 was seen; after (2, 3) alone, 5 twice and 4 once.
    assert index.continuations([1, 2, 3]) == [(4, 1.0)]
    assert index.continuations([7, 2, 3]) == [(5, 2 / 3), (4, 1 / 3)]
    assert index.continuations([8, 8, 8]) == []


@pytest.mark.parametrize("match_type", ["BFS", "PROB"])
def test_trees_branch_and_keep_to_budget_and_depth(match_type: str) -> None:
    index = _index(match_type=match_type, max_breadth=4)
    for ending in ([10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]):
        index.add([1, 2, 3, *ending], 0)
    tree = index.propose([0, 1, 2, 3], budget=8, max_depth=18)
    assert len(tree) == 8 and not tree.is_chain
    assert set(tree.children()[0]) == {10, 20, 30}
    assert len(index.propose([0, 1, 2, 3], budget=3, max_depth=18)) == 3
    assert index.propose([0, 1, 2, 3], budget=8, max_depth=2).depth == 2
    assert len(index.propose([0, 1, 2, 3], budget=8, max_depth=0)) == 1


def test_prob_grows_the_likeliest_branch_first() -> None:
    index = _index(match_type="PROB", max_window=2)
    for _ in range(9):
        index.add([1, 2, 40, 41, 42, 43], 0)
    index.add([1, 2, 50, 51, 52, 53], 0)
    tree = index.propose([1, 2], budget=5, max_depth=18)
    # 90% then ~100% down the common branch beats the 10% branch's first node.
    assert tree.tokens == [2, 40, 41, 42, 43]


def test_the_index_stays_bounded_and_keeps_what_is_used() -> None:
    index = _index(capacity=100, max_window=2)
    kept = [1000, 1001, 1002]
    index.add(kept, 0)
    for start in range(0, 5000, 10):
        index.add(list(range(start, start + 10)), 0)  # 19 new n-grams: fewer than half the capacity
        assert index.continuations([1000, 1001]) == [(1002, 1.0)]  # read, so kept young
        assert len(index) <= 100
    counts = _index(max_window=1)
    for token in range(20):
        counts.add([7, token], 0)
    assert len(counts.continuations([7])) == MAX_CONTINUATIONS
