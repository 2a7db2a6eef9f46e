"""DraftTree: depths, children, paths and the visibility mask a verify step attends with."""

from __future__ import annotations

import pytest
import torch

from radixserve.forward.draft_tree import DraftTree


def test_a_chain_is_causal() -> None:
    tree = DraftTree.chain(7, [1, 2, 3])
    assert tree.is_chain and tree.depth == 3 and len(tree) == 4
    assert torch.equal(tree.visibility(), torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    assert tree.path_tokens(3) == [1, 2, 3]


def test_a_tree_sees_only_its_ancestors() -> None:
    #        0 (root 9)
    #      /   \
    #   1 (4)  2 (5)
    #    |       \
    #   3 (6)    4 (4)
    tree = DraftTree([9, 4, 5, 6, 4], [-1, 0, 0, 1, 2])
    assert not tree.is_chain
    assert tree.depths == [0, 1, 1, 2, 2]
    assert tree.children() == [{4: 1, 5: 2}, {6: 3}, {4: 4}, {}, {}]
    assert tree.path_tokens(4) == [5, 4]
    expected = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]],
        dtype=torch.bool,
    )
    assert torch.equal(tree.visibility(), expected)


@pytest.mark.parametrize(
    "tokens,parents", [([], []), ([1, 2], [0, 0]), ([1, 2, 3], [-1, 2, 0]), ([1], [-1, 0])]
)
def test_malformed_trees_are_refused(tokens: list[int], parents: list[int]) -> None:
    with pytest.raises(ValueError):
        DraftTree(tokens, parents)
