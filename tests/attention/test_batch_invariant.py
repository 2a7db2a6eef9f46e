"""cpu_native in batch-invariant mode (--enable-deterministic-inference): a query's attention has the
same bits alone or in any batch, with any thread count, in an extend of any chunking, behind a cached
prefix or not, and as a decode query: one kernel, pieces fixed by the query's own context length."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from radixserve.attention.base import AttentionBackendUnavailable, AttentionSpec, LayerInputs
from radixserve.attention.cpu_native import INVARIANT_PIECE_TOKENS, CpuNativeBackend
from radixserve.attention.registry import choose_attention_backend
from radixserve.attention.torch_native import TorchNativeBackend
from radixserve.forward.batch import ExtendSegment, ForwardMode, build_decode_layout
from radixserve.kernels.cpu_ops import CpuKernels
from tests.conftest import native_kernels_or_skip

HEADS, KV_HEADS, DIM = 6, 2, 32
# Contexts across several pieces, exactly on and just past piece boundaries, and tiny ones.
LENGTHS = [300, INVARIANT_PIECE_TOKENS + 1, 5, 1, INVARIANT_PIECE_TOKENS, 2 * INVARIANT_PIECE_TOKENS + 1]
DTYPES = [torch.float32, torch.bfloat16]


def _spec(kernels: CpuKernels | None, dtype: torch.dtype, invariant: bool = True) -> AttentionSpec:
    return AttentionSpec(
        1, HEADS, KV_HEADS, DIM, dtype, torch.device("cpu"), kernels, 0, batch_invariant=invariant
    )


@pytest.fixture
def kernels() -> Iterator[CpuKernels]:
    kernels = native_kernels_or_skip()
    yield kernels
    kernels.set_decode_fixed_pieces(0)  # the library's default, for the tests that follow


def _pool(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K/V of every context in LENGTHS at scattered slots, and the slot table (a row per context)."""
    torch.manual_seed(0)
    slots = sum(LENGTHS) + 16
    k_cache = torch.randn(slots, KV_HEADS, DIM).to(dtype)
    v_cache = torch.randn(slots, KV_HEADS, DIM).to(dtype)
    table = torch.zeros(len(LENGTHS), max(LENGTHS), dtype=torch.int64)
    perm = torch.randperm(slots)
    offset = 0
    for row, n in enumerate(LENGTHS):
        table[row, :n] = perm[offset : offset + n]
        offset += n
    return k_cache, v_cache, table


def _decode(backend: CpuNativeBackend, q: torch.Tensor, pool: tuple[torch.Tensor, ...], rows: list[int],
            lens: list[int]) -> torch.Tensor:  # fmt: skip
    k_cache, v_cache, table = pool
    layout = build_decode_layout(table, torch.tensor(rows), torch.tensor(lens))
    metadata = backend.plan_decode(layout)
    assert metadata.shared_prefix is None  # even though every context starts differently or not
    new = q[:, :KV_HEADS]
    return backend.decode(LayerInputs(0, q, new, new, k_cache, v_cache, DIM**-0.5), metadata)


def _extend(backend: CpuNativeBackend, q: torch.Tensor, pool: tuple[torch.Tensor, ...],
            parts: list[tuple[int, int, int]]) -> torch.Tensor:  # fmt: skip
    """One extend forward of parts (table row, prefix length, new tokens); q holds their rows."""
    k_cache, v_cache, table = pool
    segments, start = [], 0
    for row, prefix, n in parts:
        context = table[row, : prefix + n]
        segments.append(ExtendSegment(start, n, prefix, context[:prefix], context))
        start += n
    metadata = backend.plan_extend(ForwardMode.EXTEND, segments)
    new = q[:, :KV_HEADS]
    return backend.extend(LayerInputs(0, q, new, new, k_cache, v_cache, DIM**-0.5), metadata)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_is_the_same_alone_in_any_batch_and_with_any_thread_count(
    kernels: CpuKernels, dtype: torch.dtype
) -> None:
    backend = CpuNativeBackend(_spec(kernels, dtype))
    pool = _pool(dtype)
    q = torch.randn(len(LENGTHS), HEADS, DIM).to(dtype)
    rows = list(range(len(LENGTHS)))
    together = _decode(backend, q, pool, rows, LENGTHS)
    for row, n in enumerate(LENGTHS):
        alone = _decode(backend, q[row : row + 1], pool, [row], [n])
        assert torch.equal(alone[0], together[row]), f"context of {n} tokens"
    backwards = _decode(backend, q.flip(0).contiguous(), pool, rows[::-1], LENGTHS[::-1])
    assert torch.equal(backwards.flip(0), together)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(_decode(backend, q, pool, rows, LENGTHS), together)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", DTYPES)
def test_extend_rows_equal_decode_queries_whatever_the_chunks_and_the_cache(
    kernels: CpuKernels, dtype: torch.dtype
) -> None:
    backend = CpuNativeBackend(_spec(kernels, dtype))
    pool = _pool(dtype)
    row, length = 0, LENGTHS[0]
    q = torch.randn(length, HEADS, DIM).to(dtype)  # one query per position of context 0
    full = _extend(backend, q, pool, [(row, 0, length)])
    # Chunked prefill: the same rows, whichever chunk a position falls in.
    chunks = [(0, 100), (100, 250), (250, length)]
    chunked = torch.cat([_extend(backend, q[a:b], pool, [(row, a, b - a)]) for a, b in chunks])
    assert torch.equal(chunked, full)
    # Behind a cached prefix of 200 tokens, in a batch with another request's extend.
    other = torch.randn(5, HEADS, DIM).to(dtype)
    mixed = _extend(backend, torch.cat([other, q[200:]]), pool, [(2, 0, 5), (row, 200, length - 200)])
    assert torch.equal(mixed[5:], full[200:])
    # As decode queries, alone and in a batch.
    for position in (0, INVARIANT_PIECE_TOKENS - 1, INVARIANT_PIECE_TOKENS, length - 1):
        decoded = _decode(backend, q[position : position + 1], pool, [row], [position + 1])
        assert torch.equal(decoded[0], full[position]), f"position {position}"
    batch = _decode(backend, q[[10, 299]].contiguous(), pool, [row, row], [11, 300])
    assert torch.equal(batch, full[[10, 299]])


def test_only_cpu_native_runs_batch_invariant(kernels: CpuKernels) -> None:
    spec = _spec(kernels, torch.bfloat16)
    assert choose_attention_backend("auto", spec).backend is CpuNativeBackend
    with pytest.raises(AttentionBackendUnavailable, match="cpu_native only"):
        choose_attention_backend("torch_native", spec)
    with pytest.raises(AttentionBackendUnavailable, match="cpu_native only"):
        choose_attention_backend("auto", _spec(None, torch.bfloat16))
    assert choose_attention_backend("auto", _spec(None, torch.bfloat16, False)).backend is TorchNativeBackend
    assert "batch-invariant" in CpuNativeBackend(spec).decode_path
