from __future__ import annotations

import pytest
import torch

from radixserve.cache.pools import KVCachePool, KVSlotAllocator, ReqToTokenPool


def _assert_aligned(slots: torch.Tensor, start_pos: int, page_size: int) -> None:
    pos = torch.arange(start_pos, start_pos + slots.numel())
    assert torch.equal(slots % page_size, pos % page_size), (slots.tolist(), start_pos)


# ---- ReqToTokenPool ---------------------------------------------------------


def test_req_pool_alloc_free_reuse() -> None:
    pool = ReqToTokenPool(3, 16)
    assert pool.req_to_token.shape == (3, 16)
    assert pool.req_to_token.dtype == torch.int64
    got = [pool.alloc() for _ in range(3)]
    assert sorted(i for i in got if i is not None) == [0, 1, 2]
    assert pool.alloc() is None
    assert pool.available_size() == 0
    pool.free(1)
    assert pool.available_size() == 1
    assert pool.alloc() == 1
    pool.clear()
    assert pool.available_size() == 3


def test_req_pool_double_free_raises() -> None:
    pool = ReqToTokenPool(2, 4)
    idx = pool.alloc()
    assert idx is not None
    pool.free(idx)
    with pytest.raises(ValueError, match="double free"):
        pool.free(idx)
    with pytest.raises(ValueError):
        pool.free(5)


# ---- KVCachePool ------------------------------------------------------------


def test_kv_cache_pool_write_and_bytes() -> None:
    pool = KVCachePool(8, num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float16, device="cpu")
    assert len(pool.k_buffers) == 2 and pool.k_buffers[0].shape == (8, 2, 4)
    k = torch.randn(3, 2, 4, dtype=torch.float32)
    v = torch.randn(3, 2, 4, dtype=torch.float32)
    loc = torch.tensor([5, 0, 7])
    pool.write(1, loc, k, v)
    assert pool.k_buffers[1].dtype == torch.float16
    torch.testing.assert_close(pool.k_buffers[1][loc], k.half())
    torch.testing.assert_close(pool.v_buffers[1][loc], v.half())
    assert pool.k_buffers[0].abs().sum() == 0
    assert KVCachePool.bytes_per_slot(2, 2, 4, torch.float16) == 2 * 2 * 2 * 4 * 2
    assert KVCachePool.bytes_per_slot(32, 8, 128, torch.bfloat16) == 131072


# ---- KVSlotAllocator, page_size 1 -------------------------------------------


def test_allocator_page1_alloc_free_reuse() -> None:
    a = KVSlotAllocator(10)
    assert a.total_slots == 10 and a.available_size() == 10
    s = a.alloc_extend([0, 0], [-1, -1], [3, 4])
    assert s is not None and s.dtype == torch.int64 and s.numel() == 7
    assert len(set(s.tolist())) == 7
    assert a.available_size() == 3
    d = a.alloc_decode([3, 4], [int(s[2]), int(s[6])])
    assert d is not None and d.numel() == 2
    assert not set(d.tolist()) & set(s.tolist())
    a.free(s)
    assert a.available_size() == 8
    again = a.alloc_extend([0], [-1], [8])
    assert again is not None and set(again.tolist()) == set(range(10)) - set(d.tolist())
    a.clear()
    assert a.available_size() == 10


def test_allocator_exhaustion_allocates_nothing() -> None:
    a = KVSlotAllocator(5)
    assert a.alloc_extend([0, 0], [-1, -1], [3, 3]) is None
    assert a.available_size() == 5
    s = a.alloc_extend([0], [-1], [4])
    assert s is not None
    assert a.alloc_decode([4, 1], [int(s[-1]), 0]) is None
    assert a.available_size() == 1
    assert a.alloc_decode([4], [int(s[-1])]) is not None
    assert a.available_size() == 0


def test_allocator_double_free_raises_page1() -> None:
    a = KVSlotAllocator(4)
    s = a.alloc_extend([0], [-1], [2])
    assert s is not None
    a.free(s[:1])
    with pytest.raises(ValueError, match="double free"):
        a.free(s[:1])
    with pytest.raises(ValueError, match="double free"):
        a.free(torch.cat([s[1:], s[1:]]))
    a.free(torch.empty(0, dtype=torch.int64))  # no-op
    assert a.available_size() == 3


# ---- KVSlotAllocator, page_size > 1 -----------------------------------------


def test_allocator_paged_usable_slots() -> None:
    a = KVSlotAllocator(18, page_size=4)
    assert a.total_slots == 16 and a.available_size() == 16


def test_allocator_paged_extend_alignment_across_pages() -> None:
    ps = 4
    a = KVSlotAllocator(64, page_size=ps)
    # Fresh requests: 6 tokens -> 2 pages, 1 token -> 1 page, 0 tokens -> nothing.
    s = a.alloc_extend([0, 0, 0], [-1, -1, -1], [6, 1, 0])
    assert s is not None and s.numel() == 7
    _assert_aligned(s[:6], 0, ps)
    _assert_aligned(s[6:], 0, ps)
    assert a.available_size() == 64 - 3 * ps
    r0 = s[:6]
    # Continue request 0 from position 6: fills slots 6,7 of its partial page, then a new page.
    more = a.alloc_extend([6], [int(r0[-1])], [5])
    assert more is not None and more.numel() == 5
    _assert_aligned(more, 6, ps)
    assert int(more[0]) == int(r0[-1]) + 1 and int(more[1]) == int(r0[-1]) + 2
    assert more[2] // ps != r0[-1] // ps
    assert a.available_size() == 64 - 4 * ps
    # Extend that fits entirely in the current partial page takes no new page.
    tiny = a.alloc_extend([11], [int(more[-1])], [1])
    assert tiny is not None and int(tiny[0]) == int(more[-1]) + 1
    assert a.available_size() == 64 - 4 * ps


def test_allocator_paged_decode_across_boundary() -> None:
    ps = 4
    a = KVSlotAllocator(32, page_size=ps)
    s = a.alloc_extend([0, 0], [-1, -1], [3, 4])
    assert s is not None
    last = [int(s[2]), int(s[6])]
    # Request 0 has 3 tokens (stays in page), request 1 has 4 (needs a new page).
    d = a.alloc_decode([3, 4], last)
    assert d is not None
    assert int(d[0]) == last[0] + 1
    assert int(d[1]) % ps == 0 and int(d[1]) // ps != last[1] // ps
    assert a.available_size() == 32 - 3 * ps
    # Continue decoding request 1 for a full page and check alignment each step.
    cur, seq = int(d[1]), 5
    for _ in range(6):
        nd = a.alloc_decode([seq], [cur])
        assert nd is not None
        assert int(nd[0]) % ps == seq % ps
        cur, seq = int(nd[0]), seq + 1


def test_allocator_paged_exhaustion_and_free_whole_pages() -> None:
    ps = 4
    a = KVSlotAllocator(8, page_size=ps)
    s = a.alloc_extend([0], [-1], [5])
    assert s is not None
    assert a.available_size() == 0
    # Filling the partial page needs nothing, but the second request needs a page.
    assert a.alloc_extend([5, 0], [int(s[-1]), -1], [3, 1]) is None
    fill = a.alloc_extend([5], [int(s[-1])], [3])
    assert fill is not None and fill.tolist() == [int(s[-1]) + 1, int(s[-1]) + 2, int(s[-1]) + 3]
    a.free(s[4:])  # one slot -> frees its whole page
    assert a.available_size() == ps
    with pytest.raises(ValueError, match="double free"):
        a.free(s[4:5])
    a.free(s[:4])
    assert a.available_size() == 2 * ps


def test_allocator_paged_failure_is_atomic() -> None:
    ps = 4
    a = KVSlotAllocator(12, page_size=ps)
    s = a.alloc_extend([0], [-1], [2])
    assert s is not None
    # Request A fits in its partial page, B needs 3 pages but only 2 free.
    assert a.alloc_extend([2, 0], [int(s[-1]), -1], [2, 9]) is None
    assert a.available_size() == 8
    assert a.alloc_decode([4, 0, 0], [int(s[-1]) + 2, -1, -1]) is None
    assert a.available_size() == 8


def test_allocator_paged_rejects_misaligned_last_loc() -> None:
    a = KVSlotAllocator(16, page_size=4)
    with pytest.raises(ValueError):
        a.alloc_extend([2], [4], [1])
    with pytest.raises(ValueError):
        a.alloc_decode([3], [4])
