"""The storage tier behind a live server: its counters in /get_server_info and /metrics, the clear
route, and a warm restart (a new server process on the same directory serves the first one's
prefixes from disk)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

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

    second = start_server(tiny_model_dir("llama"), *_flags(directory))
    assert second.server_info()["hicache_storage_pages"] >= len(PROMPT) // 16 - 1
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
    second.assert_idle_and_kv_intact()
