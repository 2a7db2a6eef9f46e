"""Sliding-window attention in the torch paths against a dense reference by absolute position: a
query at position p sees the keys at positions p - window < j <= p (transformers' convention).
Extend (with and without a cached prefix, in blocks of queries), decode (buckets, staging), tree
verify; and the native backend's decode within the window."""

from __future__ import annotations

import pytest
import torch

from radixserve.attention.base import (
    AttentionSpec,
    LayerInputs,
    TreeVerifyMetadata,
)
from radixserve.attention.common import visible_keys
from radixserve.attention.cpu_native import CpuNativeBackend
from radixserve.attention.extend import MIN_WINDOW_BLOCK, extend_attention, tree_attention
from radixserve.attention.registry import choose_attention_backend
from radixserve.attention.torch_native import TorchNativeBackend
from radixserve.attention.varlen import plan_varlen_extend
from radixserve.forward.batch import ExtendSegment, ForwardMode, build_decode_layout
from radixserve.forward.draft_tree import DraftTree
from radixserve.kernels.cpu_ops import CpuKernels

HEADS, KV_HEADS, DIM = 6, 2, 16
SCALE = DIM**-0.5


def _spec(window: int | None, staging: int = 0, kernels: CpuKernels | None = None) -> AttentionSpec:
    return AttentionSpec(1, HEADS, KV_HEADS, DIM, torch.float32, torch.device("cpu"), kernels, staging,
                         sliding_window=window)  # fmt: skip


def _dense(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor,
    window: int | None, seen: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """q [L, H, D] at query_pos over k, v [S, Hkv, D] at key_pos, causal and within the window (and
    where `seen` allows), in float64."""
    mask = key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)
    if window is not None:
        mask &= key_pos.unsqueeze(0) > query_pos.unsqueeze(1) - window
    if seen is not None:
        mask &= seen
    group = HEADS // KV_HEADS
    kk = k.double().repeat_interleave(group, dim=1).transpose(0, 1)
    vv = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = (q.double().transpose(0, 1) @ kk.transpose(1, 2) * SCALE).masked_fill(~mask, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ vv).transpose(0, 1).float()


def test_the_window_counts_the_query_itself() -> None:
    seen = visible_keys(torch.tensor([0, 3, 5]), torch.arange(6), window=3)
    assert seen.int().tolist() == [[1, 0, 0, 0, 0, 0], [0, 1, 1, 1, 0, 0], [0, 0, 0, 1, 1, 1]]
    assert visible_keys(torch.tensor([5]), torch.arange(6), None).all()


def _extend_case(
    shapes: list[tuple[int, int]], seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[ExtendSegment]]:
    """Segments of (prefix_len, q_len) over a shuffled pool; the new tokens' K/V written into it."""
    torch.manual_seed(seed)
    total_q = sum(q for _, q in shapes)
    slots = torch.randperm(sum(p + q for p, q in shapes) + 16)
    k_cache, v_cache = torch.randn(len(slots), KV_HEADS, DIM), torch.randn(len(slots), KV_HEADS, DIM)
    q = torch.randn(total_q, HEADS, DIM)
    segments, used, row = [], 0, 0
    for prefix, length in shapes:
        context = slots[used : used + prefix + length]
        segments.append(ExtendSegment(row, length, prefix, context[:prefix], context))
        used, row = used + prefix + length, row + length
    new = torch.cat([seg.context_slots[seg.prefix_len :] for seg in segments])  # type: ignore[index]
    return q, k_cache[new], v_cache[new], k_cache, v_cache, segments


def _extend_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seg: ExtendSegment, window: int | None
) -> torch.Tensor:
    assert seg.context_slots is not None
    rows = slice(seg.q_start, seg.q_start + seg.q_len)
    keys, values = k_cache[seg.context_slots], v_cache[seg.context_slots]
    query_pos = torch.arange(seg.prefix_len, seg.prefix_len + seg.q_len)
    return _dense(q[rows], keys, values, query_pos, torch.arange(seg.prefix_len + seg.q_len), window)


@pytest.mark.parametrize("window", [1, 5, 12])
def test_extend_sees_only_the_window_by_absolute_position(window: int) -> None:
    """Prompts shorter and longer than the window, with and without a cached prefix (shorter and
    longer than it, and two segments on the very same prefix, which a full layer would cascade),
    and one long enough to run in several blocks of queries."""
    shapes = [(0, 4), (0, 30), (3, 2), (20, 9), (40, 40), (40, 6), (7, MIN_WINDOW_BLOCK + 70)]
    q, k, v, k_cache, v_cache, segments = _extend_case(shapes, seed=window)
    segments[5] = ExtendSegment(segments[5].q_start, 6, 40, segments[4].prefix_slots, None)
    prefix_k = k_cache[segments[4].prefix_slots]
    out = extend_attention(q, k, v, k_cache, v_cache, segments, SCALE, window=window)
    for index, seg in enumerate(segments):
        rows = slice(seg.q_start, seg.q_start + seg.q_len)
        if index == 5:  # its new tokens' K/V are in k, v only
            keys, values = torch.cat((prefix_k, k[rows])), torch.cat((v_cache[seg.prefix_slots], v[rows]))
            expected = _dense(q[rows], keys, values, torch.arange(40, 46), torch.arange(46), window)
        else:
            expected = _extend_reference(q, k_cache, v_cache, seg, window)
        torch.testing.assert_close(out[rows], expected, atol=1e-5, rtol=1e-5, msg=f"segment {index}")


def test_the_torch_backend_extends_through_the_window_even_with_a_varlen_plan() -> None:
    """A sliding layer never takes the varlen flash call (which has no window here): the same
    forward's global layers may."""
    window = 6
    q, k, v, k_cache, v_cache, segments = _extend_case([(10, 5), (0, 20)], seed=3)
    plan = plan_varlen_extend(ForwardMode.EXTEND, segments, torch.device("cpu"))
    assert plan is not None
    out = TorchNativeBackend(_spec(window)).extend(
        LayerInputs(0, q, k, v, k_cache, v_cache, SCALE, window), plan
    )
    for seg in segments:
        rows = slice(seg.q_start, seg.q_start + seg.q_len)
        torch.testing.assert_close(
            out[rows], _extend_reference(q, k_cache, v_cache, seg, window), atol=1e-5, rtol=1e-5
        )


@pytest.mark.parametrize("staging", [0, 4096])
@pytest.mark.parametrize("window", [1, 4, 16])
def test_decode_sees_only_the_window(window: int, staging: int) -> None:
    """Lengths around the window in one bucket and in several, every request sharing a 40-slot
    prefix (which the backend of a model with a window does not cascade); two steps, the second
    appending to the staged K/V."""
    torch.manual_seed(window + staging)
    lengths = [45, 50, 52, 41, 3, 16, 17, 90]
    k_cache, v_cache = torch.randn(400, KV_HEADS, DIM), torch.randn(400, KV_HEADS, DIM)
    shared, fresh = torch.randperm(400)[:40], iter(torch.randperm(400)[40:].tolist())
    table = torch.zeros(len(lengths), 100, dtype=torch.int64)
    for row, n in enumerate(lengths):
        own = [next(fresh) for _ in range(n + 1 - min(n, 40))]
        table[row, : n + 1] = torch.cat((shared[: min(n, 40)], torch.tensor(own)))
    backend = TorchNativeBackend(_spec(window, staging))
    assert backend.cascade is False
    for step in range(2):
        seq_lens = torch.tensor(lengths) + step
        layout = build_decode_layout(table, torch.arange(len(lengths)), seq_lens)
        metadata = backend.plan_decode(layout)
        assert all(bucket.shared_slots is None for bucket in metadata.buckets)
        q = torch.randn(len(lengths), HEADS, DIM)
        new = table[torch.arange(len(lengths)), seq_lens - 1]
        out = backend.decode(
            LayerInputs(0, q, k_cache[new], v_cache[new], k_cache, v_cache, SCALE, window), metadata
        )
        for row, n in enumerate(seq_lens.tolist()):
            slots = table[row, :n]
            expected = _dense(q[row : row + 1], k_cache[slots], v_cache[slots], torch.tensor([n - 1]),
                              torch.arange(n), window)  # fmt: skip
            torch.testing.assert_close(out[row : row + 1], expected, atol=1e-5, rtol=1e-5)
    assert len(metadata.buckets) > 1
    assert (backend.staging.appends > 0) == (staging > 0)  # the second step appended to its blocks


def test_a_windowed_layer_on_a_cascade_bucket_is_an_error_not_a_wrong_answer() -> None:
    """A backend built without the model's window plans shared-prefix buckets; a sliding layer's
    call on one raises instead of attending to the whole prefix."""
    backend = TorchNativeBackend(_spec(None))
    table = torch.arange(200).view(2, 100).clone()
    table[1, :60] = table[0, :60]
    metadata = backend.plan_decode(build_decode_layout(table, torch.arange(2), torch.tensor([70, 70])))
    assert metadata.buckets[0].shared_slots is not None
    cache = torch.randn(200, KV_HEADS, DIM)
    q = torch.randn(2, HEADS, DIM)
    with pytest.raises(RuntimeError, match="sliding-window layer"):
        backend.decode(LayerInputs(0, q, cache[:2], cache[:2], cache, cache, SCALE, 8), metadata)


@pytest.mark.parametrize("window", [2, 5, 9])
def test_tree_verify_sees_the_window_before_each_node(window: int) -> None:
    """A draft node at depth d sits at position prefix_len + d: it sees its ancestors and the
    prefix within the window before it. Chains take the extend path's window."""
    torch.manual_seed(window)
    trees = [DraftTree([1, 2, 3, 4, 5, 6, 7], [-1, 0, 0, 1, 2, 3, 5]), DraftTree.chain(1, [2, 3, 4])]
    prefix_lens = [11, 6]
    slots = torch.randperm(64)
    k_cache, v_cache = torch.randn(64, KV_HEADS, DIM), torch.randn(64, KV_HEADS, DIM)
    segments, row, used = [], 0, 0
    for tree, prefix in zip(trees, prefix_lens, strict=True):
        context = slots[used : used + prefix + len(tree)]
        segments.append(ExtendSegment(row, len(tree), prefix, context[:prefix], context))
        row, used = row + len(tree), used + prefix + len(tree)
    q = torch.randn(row, HEADS, DIM)
    new = torch.cat([seg.context_slots[seg.prefix_len :] for seg in segments])  # type: ignore[index]
    masks = [None if tree.is_chain else tree.visibility() for tree in trees]
    backend = TorchNativeBackend(_spec(window))
    metadata = TreeVerifyMetadata(ForwardMode.VERIFY, segments, masks)
    out = backend.forward(
        LayerInputs(0, q, k_cache[new], v_cache[new], k_cache, v_cache, SCALE, window), metadata
    )
    direct = tree_attention(q, k_cache[new], v_cache[new], k_cache, v_cache, segments, masks, SCALE, window)
    torch.testing.assert_close(out, direct)
    for tree, seg in zip(trees, segments, strict=True):
        assert seg.context_slots is not None
        rows = slice(seg.q_start, seg.q_start + seg.q_len)
        node_pos = seg.prefix_len + torch.tensor(tree.depths)
        key_pos = torch.cat((torch.arange(seg.prefix_len), node_pos))
        seen = torch.ones(seg.q_len, seg.prefix_len + seg.q_len, dtype=torch.bool)
        seen[:, seg.prefix_len :] = tree.visibility()
        keys, values = k_cache[seg.context_slots], v_cache[seg.context_slots]
        expected = _dense(q[rows], keys, values, node_pos, key_pos, window, seen)
        torch.testing.assert_close(out[rows], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 4, 16])
def test_the_native_backend_decodes_within_the_window(native_kernels: CpuKernels, window: int) -> None:
    """auto takes cpu_native for a model with a window. Every request shares a 40-slot prefix: the
    full layer attends it by the cascade, the sliding layer reads each request's window alone."""
    spec = _spec(window, kernels=native_kernels)
    assert choose_attention_backend("auto", spec).backend is CpuNativeBackend
    torch.manual_seed(window)
    lengths = [45, 50, 52, 41, 44, 46]
    k_cache, v_cache = torch.randn(400, KV_HEADS, DIM), torch.randn(400, KV_HEADS, DIM)
    shared, fresh = torch.randperm(400)[:40], iter(torch.randperm(400)[40:].tolist())
    table = torch.zeros(len(lengths), 100, dtype=torch.int64)
    for row, n in enumerate(lengths):
        table[row, :n] = torch.cat((shared, torch.tensor([next(fresh) for _ in range(n - 40)])))
    backend = CpuNativeBackend(spec)
    seq_lens = torch.tensor(lengths)
    metadata = backend.plan_decode(build_decode_layout(table, torch.arange(len(lengths)), seq_lens))
    assert metadata.shared_prefix is not None
    q = torch.randn(len(lengths), HEADS, DIM)
    new = table[torch.arange(len(lengths)), seq_lens - 1]
    for layer_window in (None, window):
        out = backend.decode(
            LayerInputs(0, q, k_cache[new], v_cache[new], k_cache, v_cache, SCALE, layer_window), metadata
        )
        for row, n in enumerate(lengths):
            slots = table[row, :n]
            expected = _dense(q[row : row + 1], k_cache[slots], v_cache[slots], torch.tensor([n - 1]),
                              torch.arange(n), layer_window)  # fmt: skip
            torch.testing.assert_close(out[row : row + 1], expected, atol=1e-5, rtol=1e-5)
