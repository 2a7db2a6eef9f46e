"""L2, the host-memory pool below a CUDA device pool (cache/host_storage.py), in the scheduler on
the fake executor: forced beside its CPU pool (RADIXSERVE_HICACHE_HOST_POOL=1), as the tests run
the CUDA path without a GPU. Returning turns come back from host memory alone, or from host memory
first and disk for what L2 dropped; outputs stay exact and the accounting holds on every level."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from radixserve.cache.host_storage import FORCE_HOST_POOL_ENV, HostKVStorage
from radixserve.cache.storage import PageOrigin, StorageFingerprint
from radixserve.cache.tiers import DeviceOnlyTier
from radixserve.protocol.messages import GenerateRequest, ReqOutput
from radixserve.protocol.sampling_params import SamplingParams
from radixserve.scheduler.scheduler import Scheduler
from tests.scheduler.fake_executor import FakeExecutor, greedy, make_scheduler
from tests.scheduler.test_scheduler_storage_tier import (
    MAX_NEW,
    POOL,
    STORAGE_PAGE,
    VOCAB,
    _check_exact,
    _conversations,
    _second_turns,
    _serve,
    _tier,
)


@pytest.fixture(autouse=True)
def _host_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FORCE_HOST_POOL_ENV, "1")


def _scheduler(**args: Any) -> Scheduler:
    args = {
        "enable_hierarchical_cache": True,
        "hicache_storage_page_size": STORAGE_PAGE,
        "disable_overlap_schedule": True,
        **args,
    }
    return make_scheduler(FakeExecutor(vocab_size=VOCAB, max_total_tokens=POOL), **args)


def _host(scheduler: Scheduler) -> HostKVStorage:
    host = _tier(scheduler).host
    assert host is not None
    return host


def test_without_the_forcing_a_cpu_device_pool_has_no_l2(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FORCE_HOST_POOL_ENV)
    assert isinstance(_scheduler().cache_tier, DeviceOnlyTier)


def test_l2_alone_serves_returning_turns_from_host_memory(tmp_path: Path) -> None:
    # --enable-hierarchical-cache without a storage backend: the device pool and L2.
    scheduler = _scheduler(hicache_ratio=8.0)
    tier = _tier(scheduler)
    assert tier.name == "host" and tier.storage is None
    first = _conversations(7)
    first_out = _serve(scheduler, first)
    _check_exact(first, first_out)
    tier.drain()
    second = _second_turns(first, first_out)
    second_out = _serve(scheduler, second)
    _check_exact(second, second_out)
    stats = tier.stats()
    assert stats["hicache_storage_hit_tokens"] > 0
    assert stats["hicache_host_pages_loaded"] * STORAGE_PAGE >= stats["hicache_storage_hit_tokens"]
    # The budget: --hicache-ratio times the device pool (one 8-byte token and position a slot).
    assert stats["hicache_host_budget_bytes"] == 8 * POOL * 2 * 8
    assert 0 < stats["hicache_host_bytes"] <= stats["hicache_host_budget_bytes"]
    for rid, prompt in first.items():
        stored = (len(prompt) + len(first_out[rid][0]) - 1) // STORAGE_PAGE * STORAGE_PAGE
        assert second_out[f"{rid}-2"][1] >= stored, rid
    scheduler.tree_cache.evict(POOL)
    scheduler.check_kv_invariant()


def test_a_turn_whose_prefix_is_all_in_l2_is_admitted_in_the_step_that_first_sees_it() -> None:
    # Host memory is read on the scheduler's thread as the request is looked up (no I/O thread
    # round trip), so the request does not wait in the queue for its load.
    scheduler = _scheduler(hicache_ratio=8.0)
    tier = _tier(scheduler)
    first = _conversations(7)
    first_out = _serve(scheduler, first)
    tier.drain()
    scheduler.tree_cache.evict(POOL)  # the device tree is empty: each returning prefix is in L2 alone
    second = _second_turns(first, first_out)
    for rid, prompt in second.items():
        outputs = [
            *scheduler.handle(GenerateRequest(rid, prompt, SamplingParams.from_dict(greedy(MAX_NEW)))),
            *scheduler.step(),
        ]
        first_token = [o for o in outputs if isinstance(o, ReqOutput) and o.rid == rid and o.new_token_ids]
        assert first_token, f"{rid} waited for its load"
        stored = (len(prompt) - 1) // STORAGE_PAGE * STORAGE_PAGE
        assert first_token[0].cached_tokens >= stored - STORAGE_PAGE, rid
        while rid not in [o.rid for o in outputs if isinstance(o, ReqOutput) and o.finished_reason]:
            outputs = scheduler.step()
    stats = tier.stats()
    assert stats["hicache_host_pages_loaded"] > 0 and stats["hicache_storage_loads_in_flight"] == 0
    scheduler.step()
    scheduler.check_kv_invariant()


def test_l2_is_read_first_and_disk_serves_what_l2_dropped(tmp_path: Path) -> None:
    # L2 as large as the device pool: of ten conversations it keeps the latest pages only.
    scheduler = _scheduler(
        hicache_ratio=1.0, hicache_storage_backend="file", hicache_storage_dir=str(tmp_path)
    )
    tier = _tier(scheduler)
    first = _conversations(8)
    first_out = _serve(scheduler, first)
    tier.drain()
    host = _host(scheduler)
    assert host.used_bytes == host.budget_bytes  # full: it dropped the oldest pages
    # The latest conversations first: L2 still holds theirs.
    second = dict(reversed(_second_turns(first, first_out).items()))
    _check_exact(second, _serve(scheduler, second))
    stats = tier.stats()
    pages_loaded = stats["hicache_storage_hit_tokens"] // STORAGE_PAGE
    assert 0 < stats["hicache_host_pages_loaded"] < pages_loaded  # some from L2, the rest from disk
    scheduler.tree_cache.evict(POOL)
    scheduler.check_kv_invariant()
    tier.close()
    # A restart: L2 starts empty, the disk has every page.
    after = _scheduler(hicache_ratio=1.0, hicache_storage_backend="file", hicache_storage_dir=str(tmp_path))
    third = {f"{rid}-3": [*prompt, 11] for rid, prompt in second.items()}
    _check_exact(third, _serve(after, third))
    stats = _tier(after).stats()
    assert stats["hicache_storage_hit_tokens"] > 0 and stats["hicache_host_pages_loaded"] == 0


def test_new_weights_empty_l2(tmp_path: Path) -> None:
    scheduler = _scheduler()
    first = _conversations(9)
    _serve(scheduler, first)
    _tier(scheduler).drain()
    assert len(_host(scheduler)) > 0
    _tier(scheduler).weights_changed()
    assert len(_host(scheduler)) == 0 and not _host(scheduler).enabled
    _check_exact(first, _serve(scheduler, first))
    scheduler.check_kv_invariant()


def _page(value: int) -> torch.Tensor:
    """A page of two tokens of the fake layout (one layer, K and V, one head of one value)."""
    return torch.full((1, 2, 2, 1, 1), value, dtype=torch.int64)


def test_the_host_pool_keeps_its_budget_and_its_own_copies() -> None:
    fingerprint = StorageFingerprint("m", torch.int64, 2, 1, 1, 1)
    host = HostKVStorage(fingerprint, budget_bytes=3 * 2 * 2 * 8)  # three pages of two tokens
    pages = {h: _page(h) for h in range(5)}
    for h, page in pages.items():
        assert host.put(h, page, PageOrigin(None, [h, h]))
        page.zero_()  # the caller's tensor changes: L2 holds a copy
    assert len(host) == 3 and 0 not in host and 1 not in host
    got = host.get(2)
    assert got is not None and got.flatten().tolist() == [2, 2, 2, 2]
    assert host.check() == []
    # A page larger than the whole budget is not kept.
    assert not HostKVStorage(fingerprint, budget_bytes=8).put(7, _page(7), PageOrigin(None, [7, 7]))
