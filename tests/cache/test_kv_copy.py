"""cache/kv_copy.py: K/V copies between a device pool and host memory. On a CPU they are done at
once; on a CUDA device they run on a stream of their own and must still see exactly the K/V of the
moment they were started (the CUDA half skips where torch sees no CUDA device)."""

from __future__ import annotations

import pytest
import torch

from radixserve.cache.host_storage import HostKVStorage
from radixserve.cache.kv_copy import HostDeviceCopier, ReadyKV
from radixserve.cache.storage import PageOrigin, StorageFingerprint

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

LAYERS, HEADS, HEAD_DIM, PAGE = 2, 2, 8, 4


def _pages(count: int, device: str = "cpu") -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(count)
    return [
        torch.randn(LAYERS, 2, PAGE, HEADS, HEAD_DIM, generator=generator).to(device) for _ in range(count)
    ]


def test_on_a_cpu_both_copies_are_ready_at_once_and_keep_the_values() -> None:
    copier = HostDeviceCopier(torch.device("cpu"))
    assert not copier.pins
    kv = _pages(1)[0]
    down = copier.download(kv)
    assert isinstance(down, ReadyKV) and torch.equal(down.wait(), kv)
    pages = _pages(3)
    up = copier.upload(pages)
    assert isinstance(up, ReadyKV)
    assert torch.equal(up.wait(), torch.cat(pages, dim=2))
    assert torch.equal(copier.upload(pages[:1]).wait(), pages[0])


def test_the_host_pool_keeps_pages_in_pageable_memory_unless_pinned_is_asked() -> None:
    fingerprint = StorageFingerprint("m", torch.float32, PAGE, LAYERS, HEADS, HEAD_DIM)
    pool = HostKVStorage(fingerprint, budget_bytes=4 * fingerprint.kv_bytes)
    page = _pages(1)[0]
    assert pool.put(1, page, PageOrigin(None, list(range(PAGE))))
    kept = pool.get(1)
    assert kept is not None and torch.equal(kept, page) and not kept.is_pinned()
    page.zero_()  # the pool's copy is its own
    assert not torch.equal(kept, page)


@needs_cuda
def test_a_download_sees_the_kv_it_was_started_on_whatever_the_forward_stream_does_next() -> None:
    copier = HostDeviceCopier(torch.device("cuda"))
    assert copier.pins
    pool = torch.empty(4096, HEADS, HEAD_DIM, device="cuda")
    expected = []
    copies = []
    for step in range(8):
        # Work queued before the gather must be seen: the slots are rewritten, then read.
        pool.copy_(torch.randn(4096, HEADS, HEAD_DIM, device="cuda")).add_(step)
        slots = torch.randperm(4096, device="cuda")[:512]
        gathered = pool.index_select(0, slots)
        expected.append(gathered.cpu())
        copies.append(copier.download(gathered))
        # Work queued after must not be: the gathered tensor's memory is freed and reused at once.
        del gathered
        for _ in range(4):
            torch.full((512, HEADS, HEAD_DIM), -1.0, device="cuda").mul_(3.0)
        pool.fill_(-7.0)
    for copy, want in zip(copies, expected, strict=True):
        got = copy.wait()
        assert got.device.type == "cpu" and got.is_pinned()
        assert torch.equal(got, want)


@needs_cuda
def test_an_upload_joins_pinned_and_pageable_pages_and_orders_itself_before_the_next_forward() -> None:
    copier = HostDeviceCopier(torch.device("cuda"))
    pages = _pages(5)
    pages[1] = pages[1].pin_memory()
    pages[3] = pages[3].pin_memory()
    copy = copier.upload(pages)
    # The reading stream waits for the copy stream: read at once, with no host wait in between.
    on_device = copy.wait()
    assert on_device.device.type == "cuda"
    total = (on_device * 1.0).sum(dim=(0, 1, 3, 4))
    expected = torch.cat(pages, dim=2)
    assert torch.equal(on_device.cpu(), expected)
    assert torch.allclose(total.cpu(), expected.sum(dim=(0, 1, 3, 4)))


@needs_cuda
def test_a_pinned_host_pool_keeps_its_pages_pinned() -> None:
    fingerprint = StorageFingerprint("m", torch.float32, PAGE, LAYERS, HEADS, HEAD_DIM)
    pool = HostKVStorage(fingerprint, budget_bytes=4 * fingerprint.kv_bytes, pinned_for=torch.device("cuda"))
    page = _pages(1, "cuda")[0]
    assert pool.put(7, page, PageOrigin(None, list(range(PAGE))))
    kept = pool.get(7)
    assert kept is not None and kept.is_pinned() and torch.equal(kept, page.cpu())
