"""cache/host_storage.py: L2 keeps pages in chunks it allocates a few pages at a time and reuses
dropped pages, never one a copy may still read (the CUDA half skips where torch sees no CUDA device)."""

from __future__ import annotations

import random

import pytest
import torch

from radixserve.cache.host_storage import HostKVStorage
from radixserve.cache.kv_copy import HostDeviceCopier, copy_stream
from radixserve.cache.storage import PageOrigin, StorageFingerprint

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

LAYERS, HEADS, HEAD_DIM, PAGE = 2, 2, 8, 4
FINGERPRINT = StorageFingerprint("m", torch.float32, PAGE, LAYERS, HEADS, HEAD_DIM)


def _page(seed: int, device: str = "cpu") -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(LAYERS, 2, PAGE, HEADS, HEAD_DIM, generator=generator).to(device)


def _origin(seed: int) -> PageOrigin:
    return PageOrigin(None, [seed % 1000] * PAGE)


def test_pages_come_from_chunks_and_dropped_pages_are_reused_with_the_right_contents() -> None:
    budget_pages = 6
    pool = HostKVStorage(FINGERPRINT, budget_bytes=budget_pages * FINGERPRINT.kv_bytes)
    pool._slab.chunk_bytes = 4 * FINGERPRINT.kv_bytes  # chunks of 4 pages: 6 pages take 2 chunks
    rng = random.Random(0)
    kept: dict[int, torch.Tensor] = {}
    for step in range(200):
        seed = rng.randrange(40)
        assert pool.put(seed, _page(seed), _origin(seed))
        kept[seed] = _page(seed)
        if step % 7 == 0:
            pool._remove(next(iter(pool._pages)))  # a drop that is not an eviction
    # The pool never allocated more than its budget and one page: dropped pages came back.
    assert pool._slab.pages <= budget_pages + 1
    assert len(pool) <= budget_pages
    for seed in list(pool._pages):
        got = pool.get(seed)
        assert got is not None and torch.equal(got, kept[seed])
    assert pool.check() == []


def test_a_cleared_or_disabled_pool_puts_pages_again_from_its_chunks() -> None:
    pool = HostKVStorage(FINGERPRINT, budget_bytes=3 * FINGERPRINT.kv_bytes)
    for seed in range(3):
        pool.put(seed, _page(seed), _origin(seed))
    allocated = pool._slab.pages
    pool.clear()
    for seed in range(3, 6):
        pool.put(seed, _page(seed), _origin(seed))
    assert pool._slab.pages == allocated  # the cleared pages, reused
    assert all(torch.equal(pool.get(s), _page(s)) for s in range(3, 6))  # type: ignore[arg-type]
    pool.disable("test")
    assert pool._slab.pages == 0 and len(pool) == 0


@needs_cuda
def test_a_dropped_page_is_not_written_again_before_an_upload_reading_it_is_done() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    pool = HostKVStorage(FINGERPRINT, budget_bytes=FINGERPRINT.kv_bytes, pinned_for=device)
    copier = HostDeviceCopier(device)
    first = _page(1)
    pool.put(1, first, _origin(1))
    page = pool.get(1)
    assert page is not None and page.is_pinned()
    # Hold the copy stream busy, so that the upload's copy is still queued when the page is dropped.
    with torch.cuda.stream(copy_stream(device)):
        torch.cuda._sleep(200_000_000)
    upload = copier.upload([page])
    # A one-page budget: this put evicts page 1 and must reuse its memory only after the upload.
    pool.put(2, _page(2), _origin(2))
    assert torch.equal(upload.wait().cpu(), first)
    got = pool.get(2)
    assert got is not None and torch.equal(got, _page(2))
