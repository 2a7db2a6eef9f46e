"""The storage tier in the scheduler, on the fake executor (whose "K/V" per slot is its token and
position, checked on every read): multi-turn conversations far larger than the device pool come
back from storage with exact outputs, across a restart too; bad files are never loaded; a broken
disk turns the tier off without failing a request; the KV accounting holds after every step."""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from radixserve.cache.host_storage import FORCE_HOST_POOL_ENV
from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.storage import FileKVStorage, StorageFingerprint
from radixserve.cache.storage_tier import StorageTier
from radixserve.config.server_args import ServerArgs
from radixserve.protocol.messages import GenerateRequest, ReqOutput
from radixserve.protocol.sampling_params import SamplingParams
from radixserve.scheduler.scheduler import Scheduler
from tests.cache.test_kv_events import tree_blocks
from tests.kv_event_client import follow, replay
from tests.ports import free_port
from tests.scheduler.fake_executor import (
    FakeDraft,
    FakeExecutor,
    check_kv_accounting,
    expected_output,
    greedy,
    make_scheduler,
)

VOCAB = 1024
POOL = 128  # device KV slots
STORAGE_PAGE = 8
CONVERSATIONS = 10
MAX_NEW = 12


def _scheduler(directory: Path, pool: int = POOL, **args: Any) -> Scheduler:
    args = {
        "enable_hierarchical_cache": True,
        "hicache_storage_backend": "file",
        "hicache_storage_dir": str(directory),
        "hicache_storage_page_size": STORAGE_PAGE,
        "disable_overlap_schedule": True,
        **args,
    }
    return make_scheduler(FakeExecutor(vocab_size=VOCAB, max_total_tokens=pool), **args)


def _tier(scheduler: Scheduler) -> StorageTier:
    assert isinstance(scheduler.cache_tier, StorageTier)
    return scheduler.cache_tier


def _files(tier: StorageTier) -> FileKVStorage:
    assert tier.storage is not None
    return tier.storage


def _serve(scheduler: Scheduler, prompts: dict[str, list[int]]) -> dict[str, tuple[list[int], int]]:
    """Each prompt (one at a time, as turns of a chat arrive), to the end: its output tokens and
    the cached_tokens it reported; the KV accounting checked after every step."""
    found: dict[str, tuple[list[int], int]] = {}
    for rid, prompt in prompts.items():
        outputs = scheduler.handle(GenerateRequest(rid, prompt, SamplingParams.from_dict(greedy(MAX_NEW))))
        tokens: list[int] = []
        for _ in range(1000):
            for out in outputs:
                if isinstance(out, ReqOutput) and out.rid == rid:
                    tokens += out.new_token_ids
                    if out.finished_reason is not None:
                        found[rid] = (tokens, out.cached_tokens)
            if rid in found:
                break
            check_kv_accounting(scheduler)
            outputs = scheduler.step()
        assert rid in found, f"{rid} did not finish"
    scheduler.step()  # the idle step runs the scheduler's own KV check, the tier's included
    scheduler.check_kv_invariant()
    return found


def _conversations(seed: int = 0) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {
        f"c{i}": [rng.randrange(1, VOCAB) for _ in range(rng.randrange(40, 70))] for i in range(CONVERSATIONS)
    }


def _second_turns(
    first: dict[str, list[int]], outputs: dict[str, tuple[list[int], int]]
) -> dict[str, list[int]]:
    return {f"{rid}-2": [*prompt, *outputs[rid][0], 7, 8, 9] for rid, prompt in first.items()}


def _check_exact(prompts: dict[str, list[int]], outputs: dict[str, tuple[list[int], int]]) -> None:
    for rid, prompt in prompts.items():
        assert outputs[rid][0] == expected_output(prompt, MAX_NEW, VOCAB), rid


@pytest.mark.parametrize(
    ("policy", "extra"),
    [
        ("write_through", {}),
        ("write_back", {}),
        ("write_through", {"page_size": 4}),
        ("write_through", {"chunked_prefill_size": 16}),
    ],
    ids=["write-through", "write-back", "page4", "chunked"],
)
def test_returning_turns_come_back_from_storage_with_exact_outputs(
    tmp_path: Path, policy: str, extra: dict[str, Any]
) -> None:
    scheduler = _scheduler(tmp_path, hicache_write_policy=policy, **extra)
    first = _conversations()
    # Together ten times the device pool: each conversation pushes the earlier ones out of it.
    assert sum(len(p) + MAX_NEW for p in first.values()) * 2 > CONVERSATIONS * POOL // 10
    first_out = _serve(scheduler, first)
    _check_exact(first, first_out)
    if policy == "write_back":
        scheduler.tree_cache.evict(POOL)  # what is still on the device reaches storage only now
    _tier(scheduler).drain()
    second = _second_turns(first, first_out)
    second_out = _serve(scheduler, second)
    _check_exact(second, second_out)
    stats = _tier(scheduler).stats()
    assert stats["hicache_storage_hit_tokens"] > 0 and stats["hicache_storage_load_failures"] == 0
    for rid, prompt in first.items():
        # The first turn's whole pages (its prompt and what it generated, less the last token,
        # whose K/V a finished request never computes) came from the cache.
        stored = (len(prompt) + MAX_NEW - 1) // STORAGE_PAGE * STORAGE_PAGE
        assert second_out[f"{rid}-2"][1] >= stored, rid
    scheduler.tree_cache.evict(POOL)
    scheduler.check_kv_invariant()


def test_a_restarted_scheduler_serves_the_first_ones_prefixes_from_the_same_directory(tmp_path: Path) -> None:
    first = _conversations(1)
    before = _scheduler(tmp_path)
    first_out = _serve(before, first)
    _tier(before).close()  # drains its writes, as a shutdown does
    after = _scheduler(tmp_path)
    assert len(_files(_tier(after))) > 0
    second = _second_turns(first, first_out)
    second_out = _serve(after, second)
    _check_exact(second, second_out)
    assert all(second_out[rid][1] >= STORAGE_PAGE * 4 for rid in second)
    assert _tier(after).stats()["hicache_storage_hit_tokens"] >= STORAGE_PAGE * 4 * len(second)


def test_a_corrupt_or_truncated_page_is_refused_and_the_output_stays_exact(tmp_path: Path) -> None:
    first = _conversations(2)
    before = _scheduler(tmp_path)
    first_out = _serve(before, first)
    _tier(before).close()
    files = sorted(tmp_path.glob("*/*/*.kv"))
    assert files
    corrupt: dict[Path, bytes] = {}
    for index, path in enumerate(files):
        data = path.read_bytes()
        if index % 2:
            path.write_bytes(data[: len(data) // 2])  # truncated: removed at startup
        else:
            corrupt[path] = data[:-1] + bytes([data[-1] ^ 1])  # one bit of the K/V flipped
            path.write_bytes(corrupt[path])
    after = _scheduler(tmp_path)
    assert len(_files(_tier(after))) == len(corrupt)
    assert not any(path.exists() for path in files[1::2])
    second = _second_turns(first, first_out)
    _check_exact(second, _serve(after, second))
    stats = _tier(after).stats()
    assert stats["hicache_storage_load_failures"] > 0 and stats["hicache_storage_hit_tokens"] == 0
    # Each refused file is removed, never offered again; the second turns, recomputing those
    # pages, wrote good ones in their place.
    remaining = sum(path.exists() and path.read_bytes() == data for path, data in corrupt.items())
    assert remaining == len(corrupt) - stats["hicache_storage_load_failures"]


def test_a_broken_disk_turns_the_tier_off_and_serving_goes_on(tmp_path: Path) -> None:
    scheduler = _scheduler(tmp_path)
    tier = _tier(scheduler)
    # The directory becomes a file: every write fails from now on.
    shutil.rmtree(_files(tier).directory)
    _files(tier).directory.write_bytes(b"")
    first = _conversations(3)
    first_out = _serve(scheduler, first)
    _check_exact(first, first_out)
    tier.drain()
    assert not _files(tier).enabled  # one log line said so; no request saw it
    second = _second_turns(first, first_out)
    _check_exact(second, _serve(scheduler, second))
    assert tier.stats()["hicache_storage_hit_tokens"] == 0


def test_a_draft_model_drafts_again_over_a_prefix_loaded_from_storage(tmp_path: Path) -> None:
    """STANDALONE with the storage tier: a loaded prefix holds the target's K/V only, so the draft
    model must not take what its own pool holds at those slots (an earlier occupant's K/V) as
    valid. FakeDraft fails the test on any such read; here it catches up over the loaded prefix
    instead, and every draft of the perfect fake draft is still accepted."""
    target = FakeExecutor(vocab_size=VOCAB, max_total_tokens=POOL)
    draft = FakeDraft(vocab_size=VOCAB, max_total_tokens=POOL, target=target)
    args = ServerArgs(
        enable_hierarchical_cache=True,
        hicache_storage_backend="file",
        hicache_storage_dir=str(tmp_path),
        hicache_storage_page_size=STORAGE_PAGE,
        disable_overlap_schedule=True,
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path="fake-draft",
        disable_speculative_adaptive=True,  # the fakes' timings mean nothing
        log_level="warning",
    )
    scheduler = Scheduler(args, target, draft=draft)
    first = _conversations(5)
    first_out = _serve(scheduler, first)
    _check_exact(first, first_out)
    _tier(scheduler).drain()
    second = _second_turns(first, first_out)
    second_out = _serve(scheduler, second)
    _check_exact(second, second_out)
    assert _tier(scheduler).stats()["hicache_storage_hit_tokens"] >= STORAGE_PAGE * len(second)
    stats = scheduler.stats
    assert stats.spec_draft_tokens > 0 and stats.spec_accepted_tokens == stats.spec_draft_tokens
    scheduler.tree_cache.evict(POOL)
    scheduler.check_kv_invariant()


def _one_page_short(values: list[int]) -> list[int]:
    """Plays a second tensor-parallel rank in StorageTier.least: each lookup finds one page fewer
    there, and each load read one page fewer (unfinished loads, -1, stay unfinished)."""
    return [value - 1 if value > 0 else value for value in values]


def test_tensor_parallel_ranks_load_only_the_pages_every_rank_has(tmp_path: Path) -> None:
    hits = []
    for least in (None, _one_page_short):
        scheduler = _scheduler(tmp_path / ("agreed" if least else "alone"))
        if least is not None:
            _tier(scheduler).least = least
        first = _conversations(6)
        first_out = _serve(scheduler, first)
        _tier(scheduler).drain()
        second = _second_turns(first, first_out)
        _check_exact(second, _serve(scheduler, second))
        hits.append(_tier(scheduler).stats()["hicache_storage_hit_tokens"])
    alone, agreed = hits
    # Two pages fewer per load (one not found there, one not read there), the outputs unchanged.
    assert 0 < agreed < alone


def test_a_directory_that_cannot_be_made_means_no_storage_tier(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    scheduler = _scheduler(blocker / "below")
    assert not _files(_tier(scheduler)).enabled
    first = _conversations(4)
    _check_exact(first, _serve(scheduler, first))


def test_write_through_selective_writes_only_what_a_prompt_hit_again(tmp_path: Path) -> None:
    scheduler = _scheduler(tmp_path, hicache_write_policy="write_through_selective")
    tier = _tier(scheduler)
    first = dict(list(_conversations(5).items())[:1])
    first_out = _serve(scheduler, first)
    tier.drain()
    assert len(_files(tier)) == 0  # inserted and used once: not written
    second = _second_turns(first, first_out)
    _check_exact(second, _serve(scheduler, second))  # its prompt hits the first turn on the device
    tier.drain()
    (prompt,) = first.values()
    assert len(_files(tier)) == (len(prompt) + MAX_NEW - 1) // STORAGE_PAGE


def test_clearing_the_storage_backend_removes_every_page(tmp_path: Path) -> None:
    scheduler = _scheduler(tmp_path)
    tier = _tier(scheduler)
    first = _conversations(6)
    first_out = _serve(scheduler, first)
    tier.drain()
    assert len(_files(tier)) > 0
    tier.clear()
    tier.drain()
    assert len(_files(tier)) == 0 and not list(tmp_path.glob("*/*/*.kv"))
    second = _second_turns(first, first_out)
    _check_exact(second, _serve(scheduler, second))
    scheduler.check_kv_invariant()


def test_retracted_requests_resume_exactly_with_the_tier_below(tmp_path: Path) -> None:
    # Admitting optimistically, so that decoding runs out of room and retracts.
    scheduler = _scheduler(tmp_path, pool=96, schedule_conservativeness=0.05)
    prompts = {rid: prompt[:24] for rid, prompt in _conversations(7).items()}
    long_new = 40
    finished: dict[str, list[int]] = {}
    for rid, prompt in prompts.items():  # all at once: their outputs outgrow the pool
        scheduler.handle(GenerateRequest(rid, prompt, SamplingParams.from_dict(greedy(long_new))))
    for _ in range(5000):
        check_kv_accounting(scheduler)
        if scheduler.is_idle:
            break
        for out in scheduler.step():
            if isinstance(out, ReqOutput):
                finished.setdefault(out.rid, []).extend(out.new_token_ids)
    assert scheduler.is_idle and scheduler.stats.retracted_reqs > 0
    for rid, prompt in prompts.items():
        assert finished[rid] == expected_output(prompt, long_new, VOCAB), rid
    scheduler.step()
    scheduler.check_kv_invariant()


# Room for this many storage pages: the subscriber test's disk evicts (least recently used).
EVENTS_TEST_PAGES = 48


def _with_events(directory: Path) -> Scheduler:
    layout = FakeExecutor().kv_layout()
    page = StorageFingerprint(
        "", layout.dtype, STORAGE_PAGE, layout.num_layers, layout.num_kv_heads, layout.head_dim
    )
    config = {
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{free_port()}",
        "replay_endpoint": f"tcp://127.0.0.1:{free_port()}",
        "buffer_steps": 100_000,
    }
    budget_gb = EVENTS_TEST_PAGES * page.page_bytes / (1 << 30)
    return _scheduler(directory, kv_events_config=json.dumps(config), hicache_storage_size_gb=budget_gb)


def _replayed_blocks(scheduler: Scheduler) -> dict[str | None, set[int]]:
    """What a subscriber that joins now rebuilds from the replay alone (once every batch so far
    has been published)."""
    _tier(scheduler).drain()
    scheduler.step()  # publishes what the I/O thread recorded meanwhile
    publisher = scheduler.kv_events
    assert publisher is not None and publisher.replay_endpoint is not None
    deadline = time.monotonic() + 30
    while not publisher._queue.empty() and time.monotonic() < deadline:
        time.sleep(0.01)
    replayed = replay(publisher.replay_endpoint)
    assert [seq for seq, _ in replayed] == list(range(publisher.published))
    return follow([batch for _, batch in replayed])


def _own_view(scheduler: Scheduler) -> dict[str | None, set[int]]:
    assert isinstance(scheduler.tree_cache, RadixCache)
    tier = _tier(scheduler)
    view = {"CPU": tree_blocks(scheduler.tree_cache), "DISK": set(_files(tier)._pages)}
    if tier.host is not None:  # an L2 forced beside the CPU device pool: medium "HOST"
        view["HOST"] = set(tier.host._pages)
    return {medium: blocks for medium, blocks in view.items() if blocks}


def _shut(scheduler: Scheduler) -> None:
    assert scheduler.kv_events is not None
    scheduler.kv_events.shutdown()
    _tier(scheduler).close()


@pytest.mark.parametrize("host_pool", [False, True], ids=["disk", "host-and-disk"])
def test_a_subscriber_rebuilds_every_tiers_blocks_from_the_events_alone(
    tmp_path: Path, host_pool: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if host_pool:
        monkeypatch.setenv(FORCE_HOST_POOL_ENV, "1")
    scheduler = _with_events(tmp_path)
    assert (_tier(scheduler).host is not None) == host_pool
    try:
        first = _conversations(8)
        first_out = _serve(scheduler, first)  # ten times the pool: evictions, writes to disk
        _tier(scheduler).drain()
        assert len(_files(_tier(scheduler))) == EVENTS_TEST_PAGES  # and the disk's own evictions
        # The latest first, while the disk still holds them (the disk's own evictions are LRU).
        second = dict(reversed(_second_turns(first, first_out).items()))
        _check_exact(second, _serve(scheduler, second))  # loads from disk
        assert _tier(scheduler).stats()["hicache_storage_hit_tokens"] > 0
        assert _replayed_blocks(scheduler) == _own_view(scheduler)
        # flush_cache empties the device tree (AllBlocksCleared, which makes subscribers forget
        # every medium) but not the disk, whose pages are announced again after it.
        assert scheduler.flush_cache()
        view = _own_view(scheduler)
        assert "CPU" not in view and view["DISK"] and ("HOST" in view) == host_pool
        assert _replayed_blocks(scheduler) == view
        third = {f"{rid}-3": prompt[:30] for rid, prompt in second.items()}
        _check_exact(third, _serve(scheduler, third))
        assert _replayed_blocks(scheduler) == _own_view(scheduler)
        _tier(scheduler).clear()  # /clear_hicache_storage_backend: the disk's pages, removed
        assert _replayed_blocks(scheduler) == _own_view(scheduler)
        assert not {"DISK", "HOST"} & set(_own_view(scheduler))
        _serve(scheduler, dict(list(first.items())[:3]))
        final = _replayed_blocks(scheduler)
        assert final == _own_view(scheduler) and final["DISK"]
    finally:
        _shut(scheduler)
    # A restart on the same directory: its stream opens with what the disk holds.
    restarted = _with_events(tmp_path)
    try:
        assert _replayed_blocks(restarted) == {"DISK": final["DISK"]} == _own_view(restarted)
    finally:
        _shut(restarted)
