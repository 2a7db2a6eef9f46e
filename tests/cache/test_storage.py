"""The storage tier's file backend (cache/storage.py): pages come back bit for bit, a page of
another model, dtype, page size or version is never read, the disk budget holds (least recently
used out first), a restart finds what was stored, and a disk that fails turns the tier off
instead of failing."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

from radixserve.cache.block_hash import page_hash, page_hashes
from radixserve.cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventRecorder
from radixserve.cache.pools import KVCachePool
from radixserve.cache.storage import FileKVStorage, PageOrigin, StorageFingerprint

FINGERPRINT = StorageFingerprint(
    "tiny-llama:abc", torch.bfloat16, 2, num_layers=3, num_kv_heads=2, head_dim=4
)


def page(seed: int, fingerprint: StorageFingerprint = FINGERPRINT) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(fingerprint.page_shape, generator=generator).to(fingerprint.dtype)


def h(n: int) -> int:
    """The hash of page n: a first page holding the tokens [n, n]."""
    return page_hash(None, [n, n])


def put(store: FileKVStorage, n: int, kv: torch.Tensor | None = None) -> bool:
    return store.put(h(n), page(n) if kv is None else kv, PageOrigin(None, [n, n]))


def storage(root: Path, pages: int = 100, fingerprint: StorageFingerprint = FINGERPRINT) -> FileKVStorage:
    return FileKVStorage(root, fingerprint, budget_bytes=pages * fingerprint.page_bytes)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_page_comes_back_bit_for_bit(tmp_path: Path, dtype: torch.dtype) -> None:
    fingerprint = dataclasses.replace(FINGERPRINT, dtype=dtype)
    store = storage(tmp_path, fingerprint=fingerprint)
    kv = page(1, fingerprint)
    kv[0, 0, 0, 0, 0] = float("nan")  # any bits, not only numbers
    assert put(store, 42, kv) and h(42) in store
    back = store.get(h(42))
    assert back is not None and back.dtype == dtype
    assert torch.equal(back.view(torch.uint8), kv.view(torch.uint8))
    assert store.get(h(43)) is None


def test_the_pool_reads_and_writes_pages_across_layers() -> None:
    pool = KVCachePool(16, num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.bfloat16)
    for layer in range(3):
        pool.write(layer, torch.arange(16), torch.randn(16, 2, 4), torch.randn(16, 2, 4))
    slots = torch.tensor([5, 9])
    kv = pool.read_slots(slots)
    assert tuple(kv.shape) == FINGERPRINT.page_shape
    assert torch.equal(kv[1, 1, 0], pool.v_buffers[1][5])
    pool.write_slots(torch.tensor([0, 1]), kv)
    assert torch.equal(pool.read_slots(torch.tensor([0, 1])), kv)


@pytest.mark.parametrize(
    "other",
    [
        dataclasses.replace(FINGERPRINT, model="another-model"),
        dataclasses.replace(FINGERPRINT, dtype=torch.float32),
        dataclasses.replace(FINGERPRINT, page_size=4),
        dataclasses.replace(FINGERPRINT, num_kv_heads=1),
    ],
)
def test_another_model_dtype_or_layout_never_sees_the_pages(
    tmp_path: Path, other: StorageFingerprint
) -> None:
    store = storage(tmp_path)
    put(store, 7)
    assert h(7) not in storage(tmp_path, fingerprint=other)
    assert h(7) in storage(tmp_path)


def test_another_format_version_is_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    put(storage(tmp_path), 7)
    monkeypatch.setattr("radixserve.cache.storage.FORMAT_VERSION", 3)
    assert h(7) not in storage(tmp_path)  # the version is in the fingerprint's digest


def test_a_file_whose_header_disagrees_is_refused_and_removed(tmp_path: Path) -> None:
    store = storage(tmp_path)
    put(store, 7)
    put(store, 8)
    # Page 8's file put where page 7's belongs (a copy, a rename, a hash collision on disk).
    path7, path8 = store._path(h(7)), store._path(h(8))
    os.replace(path8, path7)
    reopened = storage(tmp_path)
    assert reopened.get(h(7)) is None and not path7.exists()
    assert reopened.used_bytes == 0 and len(reopened) == 0


def test_a_truncated_file_is_refused(tmp_path: Path) -> None:
    store = storage(tmp_path)
    put(store, 7)
    path = store._path(h(7))
    path.write_bytes(path.read_bytes()[:-1])
    assert h(7) not in storage(tmp_path) and not path.exists()  # the wrong size: removed at startup
    assert store.get(h(7)) is None  # and the process that wrote it refuses it too


def test_the_budget_evicts_the_least_recently_used(tmp_path: Path) -> None:
    store = storage(tmp_path, pages=3)
    for n in (1, 2, 3):
        put(store, n)
    assert store.get(h(1)) is not None  # 2 is now the least recently used
    put(store, 4)
    assert sorted(store._pages) == sorted(map(h, (1, 3, 4))) and not store._path(h(2)).exists()
    assert store.used_bytes == 3 * FINGERPRINT.page_bytes
    assert not put(FileKVStorage(tmp_path, FINGERPRINT, budget_bytes=FINGERPRINT.page_bytes - 1), 9)


def test_a_restart_finds_the_pages_in_their_use_order(tmp_path: Path) -> None:
    store = storage(tmp_path, pages=3)
    chain = page_hashes(None, [1, 2, 3, 4, 5, 6], 2)
    for i, block in enumerate(chain):
        store.put(block, page(i), PageOrigin(chain[i - 1] if i else None, [2 * i + 1, 2 * i + 2]))
        os.utime(store._path(block), (1000 + i, 1000 + i))  # mtimes a second apart
    restarted = storage(tmp_path, pages=3)
    assert list(restarted._pages) == chain
    assert torch.equal(restarted.get(chain[1]), page(1))  # type: ignore[arg-type]
    # A smaller budget than the last run's trims the oldest at once.
    assert list(storage(tmp_path, pages=1)._pages) == [chain[1]]


def test_a_failing_disk_turns_the_tier_off(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    store = storage(blocker)  # its directory cannot be made
    assert not store.enabled and not put(store, 1) and store.get(h(1)) is None
    assert "storage tier off" in caplog.text

    store = storage(tmp_path / "ok")
    assert put(store, 1)
    # Where page 2's file is written first, a directory: the write fails (a full disk, a read-only
    # mount or no permission fail the same way, with an OSError), whoever runs the test.
    partial = store._path(h(2)).with_suffix(f".{os.getpid()}.partial")
    partial.parent.mkdir(exist_ok=True)
    partial.mkdir()
    assert not put(store, 2)
    assert not store.enabled and not store._path(h(2)).exists()
    # Off for good: nothing stored, nothing served (the server recomputes instead).
    assert not put(store, 3) and store.get(h(1)) is None and h(1) not in store


def test_a_damaged_head_is_removed_at_startup_and_a_damaged_payload_refused_on_load(tmp_path: Path) -> None:
    store = storage(tmp_path)
    put(store, 7)
    put(store, 8)
    head_damaged, payload_damaged = store._path(h(7)), store._path(h(8))
    data = bytearray(head_damaged.read_bytes())
    data[FINGERPRINT.payload_offset - 1] ^= 1  # a token id: the name is no longer its tokens' hash
    head_damaged.write_bytes(bytes(data))
    data = bytearray(payload_damaged.read_bytes())
    data[-1] ^= 1  # one bit of the K/V: caught by the payload's CRC
    payload_damaged.write_bytes(bytes(data))
    reopened = storage(tmp_path)
    assert h(7) not in reopened and not head_damaged.exists()
    assert h(8) in reopened and reopened.get(h(8)) is None and not payload_damaged.exists()
    assert reopened.used_bytes == 0


def test_events_record_stores_removals_and_what_a_restart_finds(tmp_path: Path) -> None:
    device = KVEventRecorder(page_size=1, medium="CPU")
    store = FileKVStorage(tmp_path, FINGERPRINT, 2 * FINGERPRINT.page_bytes, device.for_medium(2, "DISK"))
    for n in (1, 2, 3):  # the third evicts the first (two pages fit)
        put(store, n)
    batch = device.take()
    assert batch is not None and batch.events == [
        BlockStored([h(1)], None, [1, 1], 2, None, "DISK"),
        BlockStored([h(2)], None, [2, 2], 2, None, "DISK"),
        BlockRemoved([h(1)], "DISK"),
        BlockStored([h(3)], None, [3, 3], 2, None, "DISK"),
    ]
    # A restart: the clear that opens its event stream (the device tree's) is followed by what
    # the disk holds, read from the files' heads.
    device = KVEventRecorder(page_size=1, medium="CPU")
    restarted = FileKVStorage(tmp_path, FINGERPRINT, 2 * FINGERPRINT.page_bytes, device.for_medium(2, "DISK"))
    device.cleared()
    batch = device.take()
    assert batch is not None and batch.events == [
        AllBlocksCleared(),
        BlockStored([h(2)], None, [2, 2], 2, None, "DISK"),
        BlockStored([h(3)], None, [3, 3], 2, None, "DISK"),
    ]
    restarted.clear()
    batch = device.take()
    assert batch is not None and batch.events == [BlockRemoved([h(2), h(3)], "DISK")]
    put(restarted, 4)
    restarted.disable("a test")  # no longer served from: its pages are announced as removed
    batch = device.take()
    assert batch is not None and batch.events[-1] == BlockRemoved([h(4)], "DISK")
