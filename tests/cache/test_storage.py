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

from radixserve.cache.block_hash import page_hashes
from radixserve.cache.pools import KVCachePool
from radixserve.cache.storage import FileKVStorage, StorageFingerprint

FINGERPRINT = StorageFingerprint(
    "tiny-llama:abc", torch.bfloat16, 2, num_layers=3, num_kv_heads=2, head_dim=4
)


def page(seed: int, fingerprint: StorageFingerprint = FINGERPRINT) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(fingerprint.page_shape, generator=generator).to(fingerprint.dtype)


def storage(root: Path, pages: int = 100, fingerprint: StorageFingerprint = FINGERPRINT) -> FileKVStorage:
    return FileKVStorage(root, fingerprint, budget_bytes=pages * fingerprint.page_bytes)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_page_comes_back_bit_for_bit(tmp_path: Path, dtype: torch.dtype) -> None:
    fingerprint = dataclasses.replace(FINGERPRINT, dtype=dtype)
    store = storage(tmp_path, fingerprint=fingerprint)
    kv = page(1, fingerprint)
    kv[0, 0, 0, 0, 0] = float("nan")  # any bits, not only numbers
    assert store.put(42, kv) and 42 in store
    back = store.get(42)
    assert back is not None and back.dtype == dtype
    assert torch.equal(back.view(torch.uint8), kv.view(torch.uint8))
    assert store.get(43) is None


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
    store.put(7, page(7))
    assert 7 not in storage(tmp_path, fingerprint=other)
    assert 7 in storage(tmp_path)


def test_another_format_version_is_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    storage(tmp_path).put(7, page(7))
    monkeypatch.setattr("radixserve.cache.storage.FORMAT_VERSION", 2)
    assert 7 not in storage(tmp_path)  # the version is in the fingerprint's digest


def test_a_file_whose_header_disagrees_is_refused_and_removed(tmp_path: Path) -> None:
    store = storage(tmp_path)
    store.put(7, page(7))
    store.put(8, page(8))
    # Page 8's file put where page 7's belongs (a copy, a rename, a hash collision on disk).
    path7, path8 = store._path(7), store._path(8)
    os.replace(path8, path7)
    reopened = storage(tmp_path)
    assert reopened.get(7) is None and not path7.exists()
    assert reopened.used_bytes == 0 and len(reopened) == 0


def test_a_truncated_file_is_refused(tmp_path: Path) -> None:
    store = storage(tmp_path)
    store.put(7, page(7))
    path = store._path(7)
    path.write_bytes(path.read_bytes()[:-1])
    assert 7 not in storage(tmp_path)  # the wrong size is not even counted
    assert store.get(7) is None  # and the process that wrote it refuses it too


def test_the_budget_evicts_the_least_recently_used(tmp_path: Path) -> None:
    store = storage(tmp_path, pages=3)
    for h in (1, 2, 3):
        store.put(h, page(h))
    assert store.get(1) is not None  # 2 is now the least recently used
    store.put(4, page(4))
    assert sorted(store._pages) == [1, 3, 4] and not store._path(2).exists()
    assert store.used_bytes == 3 * FINGERPRINT.page_bytes
    assert not FileKVStorage(tmp_path, FINGERPRINT, budget_bytes=FINGERPRINT.page_bytes - 1).put(9, page(9))


def test_a_restart_finds_the_pages_in_their_use_order(tmp_path: Path) -> None:
    store = storage(tmp_path, pages=3)
    chain = page_hashes(None, [1, 2, 3, 4, 5, 6], 2)
    for i, h in enumerate(chain):
        store.put(h, page(i))
        os.utime(store._path(h), (1000 + i, 1000 + i))  # mtimes a second apart
    restarted = storage(tmp_path, pages=3)
    assert list(restarted._pages) == chain
    assert torch.equal(restarted.get(chain[1]), page(1))  # type: ignore[arg-type]
    # A smaller budget than the last run's trims the oldest at once.
    assert list(storage(tmp_path, pages=1)._pages) == [chain[1]]


def test_a_failing_disk_turns_the_tier_off(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    store = storage(blocker)  # its directory cannot be made
    assert not store.enabled and not store.put(1, page(1)) and store.get(1) is None
    assert "storage tier off" in caplog.text

    store = storage(tmp_path / "ok")
    assert store.put(1, page(1))
    # Where page 2's file is written first, a directory: the write fails (a full disk, a read-only
    # mount or no permission fail the same way, with an OSError), whoever runs the test.
    partial = store._path(2).with_suffix(f".{os.getpid()}.partial")
    partial.parent.mkdir(exist_ok=True)
    partial.mkdir()
    assert not store.put(2, page(2))
    assert not store.enabled and not store._path(2).exists()
    # Off for good: nothing stored, nothing served (the server recomputes instead).
    assert not store.put(3, page(3)) and store.get(1) is None and 1 not in store
