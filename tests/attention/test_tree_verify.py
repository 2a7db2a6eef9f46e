"""Tree-masked verify attention against a dense reference: each draft node sees the cached prefix,
itself and its ancestors, and nothing else; a chain is plain causal attention."""

from __future__ import annotations

import pytest
import torch

from radixserve.attention.base import AttentionSpec, LayerInputs, TreeVerifyMetadata
from radixserve.attention.torch_native import TorchNativeBackend
from radixserve.forward.batch import ExtendSegment, ForwardBatch, ForwardMode
from radixserve.forward.draft_tree import DraftTree

HEADS, KV_HEADS, DIM = 6, 2, 16


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """q [L, H, D] over k, v [S, Hkv, D] where seen [L, S] allows, in float64."""
    group = HEADS // KV_HEADS
    kk = k.double().repeat_interleave(group, dim=1).transpose(0, 1)
    vv = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q.double().transpose(0, 1) @ kk.transpose(1, 2) * DIM**-0.5
    scores = scores.masked_fill(~seen, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ vv).transpose(0, 1)


@pytest.mark.parametrize("with_chain", [False, True])
def test_tree_attention_matches_the_dense_reference(with_chain: bool) -> None:
    torch.manual_seed(0)
    trees = [DraftTree([1, 2, 3, 4, 5, 6], [-1, 0, 0, 1, 2, 2]), DraftTree([1, 2, 3, 4], [-1, 0, 1, 1])]
    if with_chain:
        trees.append(DraftTree.chain(1, [2, 3]))
    prefix_lens = [5, 0, 7][: len(trees)]
    slots = torch.randperm(64)
    k_cache, v_cache = torch.randn(64, KV_HEADS, DIM), torch.randn(64, KV_HEADS, DIM)
    segments, offset, used = [], 0, 0
    for tree, prefix in zip(trees, prefix_lens, strict=True):
        context = slots[used : used + prefix + len(tree)]
        used += prefix + len(tree)
        segments.append(ExtendSegment(offset, len(tree), prefix, context[:prefix], context))
        offset += len(tree)
    q = torch.randn(offset, HEADS, DIM)
    new_slots = torch.cat([seg.context_slots[seg.prefix_len :] for seg in segments])  # type: ignore[index]
    k, v = k_cache[new_slots], v_cache[new_slots]
    masks = [None if t.is_chain else t.visibility() for t in trees]
    batch = ForwardBatch(
        mode=ForwardMode.VERIFY, input_ids=torch.zeros(offset, dtype=torch.int64),
        positions=torch.zeros(offset, dtype=torch.int64), out_cache_loc=new_slots,
        sample_rows=torch.arange(offset), extend=segments, verify_masks=masks,
    )  # fmt: skip
    spec = AttentionSpec(1, HEADS, KV_HEADS, DIM, torch.float32, torch.device("cpu"), None, 0)
    backend = TorchNativeBackend(spec)
    metadata = backend.plan(batch)
    assert isinstance(metadata, TreeVerifyMetadata)
    out = backend.forward(LayerInputs(0, q, k, v, k_cache, v_cache, DIM**-0.5), metadata)
    for tree, seg in zip(trees, segments, strict=True):
        rows = slice(seg.q_start, seg.q_start + seg.q_len)
        seen = torch.ones(seg.q_len, seg.prefix_len + seg.q_len, dtype=torch.bool)
        seen[:, seg.prefix_len :] = tree.visibility()
        assert seg.context_slots is not None
        keys, values = k_cache[seg.context_slots], v_cache[seg.context_slots]
        expected = _dense(q[rows], keys, values, seen).float()
        torch.testing.assert_close(out[rows], expected, atol=1e-5, rtol=1e-5)
