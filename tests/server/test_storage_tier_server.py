"""The storage tier behind a live server: its counters in /get_server_info and /metrics, the clear
route, a warm restart (a new server process on the same directory serves the first one's
prefixes from disk), and its pages' KV events (announced at the restart, removed by the clear)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.kv_event_client import follow, replay, stored_paths
from tests.ports import free_port
from tests.server.conftest import LiveServer

PROMPT = list(range(100, 260))  # 160 tokens: ten stored pages of 16
PARAMS = {"temperature": 0.0, "max_new_tokens": 4}


def _flags(directory: Path) -> list[str]:
    return [
        "--enable-hierarchical-cache", "--hicache-storage-backend", "file",
        "--hicache-storage-dir", str(directory), "--hicache-storage-page-size", "16", "--enable-metrics",
    ]  # fmt: skip


def _generate(server: LiveServer) -> dict[str, Any]:
    with server.client() as client:
        response = client.post("/generate", json={"input_ids": PROMPT, "sampling_params": PARAMS})
        response.raise_for_status()
        result: dict[str, Any] = response.json()
        return result


def _disk_blocks_once(replay_endpoint: str, settled: Callable[[set[int]], bool]) -> tuple[set[int], Any]:
    """The DISK blocks a subscriber rebuilds from a replay, asked again until `settled` (an idle
    server publishes what its I/O thread recorded within a poll interval)."""
    deadline = time.monotonic() + 30
    while True:
        batches = [batch for _, batch in replay(replay_endpoint)]
        blocks = follow(batches).get("DISK", set())
        if settled(blocks) or time.monotonic() > deadline:
            return blocks, batches
        time.sleep(0.2)


def test_a_restarted_server_serves_the_first_ones_prefix_from_disk(
    tmp_path: Path, tiny_model_dir: Callable[[str], Path], start_server: Callable[..., LiveServer]
) -> None:
    directory = tmp_path / "hicache"
    first = start_server(tiny_model_dir("llama"), *_flags(directory))
    expected = _generate(first)["output_ids"]
    first.assert_idle_and_kv_intact()
    info = first.server_info()
    assert info["hicache_tier"] == "storage" and info["hicache_write_policy"] == "write_through"
    first.stop()  # SIGTERM: the queued writes finish before the process exits

    replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
    events = {"endpoint": f"tcp://127.0.0.1:{free_port()}", "replay_endpoint": replay_endpoint}
    second = start_server(
        tiny_model_dir("llama"), *_flags(directory), "--kv-events-config", json.dumps(events)
    )
    pages = second.server_info()["hicache_storage_pages"]
    assert pages >= len(PROMPT) // 16 - 1
    # Before any request: the pages found on disk, announced with their tokens.
    disk, batches = _disk_blocks_once(replay_endpoint, lambda blocks: len(blocks) >= pages)
    assert len(disk) == pages
    paths = stored_paths(batches)
    assert sorted(len(paths[block]) for block in disk)[:3] == [16, 32, 48]
    assert all(paths[block] == PROMPT[: len(paths[block])] for block in disk)
    result = _generate(second)
    assert result["output_ids"] == expected
    # The prompt less its last token (always computed) is whole pages up to 144 tokens.
    assert result["meta_info"]["cached_tokens"] >= 144
    with second.client() as client:
        metrics = client.get("/metrics").text
        assert "radixserve:hicache_storage_hit_tokens" in metrics
        hits = [
            line for line in metrics.splitlines() if line.startswith("radixserve:hicache_storage_hit_tokens")
        ]
        assert float(hits[0].split()[-1]) >= 144
        assert client.post("/clear_hicache_storage_backend").status_code == 200
    assert _disk_blocks_once(replay_endpoint, lambda blocks: not blocks)[0] == set()
    second.assert_idle_and_kv_intact()
