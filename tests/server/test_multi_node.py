"""Two "nodes" on loopback serve one --tp-size 2 (or --pp-size 2) model: node 0 runs the HTTP
server and rank 0, node 1 (a second launch with --node-rank 1) runs rank 1 (the second pipeline
stage) and stops when node 0 shuts down."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.engine.oracle import GreedyOracle, random_prompts
from tests.ports import free_port
from tests.server.conftest import LiveServer


@pytest.mark.parametrize("split", ["--tp-size", "--pp-size"])
def test_two_launches_with_nnodes_2_serve_one_model(
    split: str, tiny_model_dir: Callable[[str], Path], start_server: Callable[..., LiveServer], tmp_path: Path
) -> None:
    path = tiny_model_dir("llama")
    common = [split, "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{free_port()}"]
    worker_log = tmp_path / "node1.log"
    worker_cmd = [
        sys.executable, "-m", "radixserve.launch_server", "--model-path", str(path),
        "--dtype", "float32", "--max-total-tokens", "16384", "--log-level", "info",
        *common, "--node-rank", "1",
    ]  # fmt: skip
    with open(worker_log, "wb") as log:
        worker = subprocess.Popen(
            worker_cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "TMPDIR": str(tmp_path)}
        )
    try:
        live = start_server(path, *common, "--node-rank", "0")
        prompts = random_prompts(4, seed=21)
        with live.client() as client:
            body = {
                "input_ids": prompts,
                "sampling_params": {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True},
            }
            results = client.post("/generate", json=body).json()
        oracle = GreedyOracle(path)
        assert [r["output_ids"] for r in results] == [oracle.continue_(p, 8) for p in prompts]
        live.assert_idle_and_kv_intact()
        live.stop()
        # Node 0 shut the model down; node 1's rank followed and the worker ended cleanly.
        assert worker.wait(timeout=60) == 0, worker_log.read_text()
        assert "node 0 shut the model down" in worker_log.read_text()
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


def test_a_worker_node_with_a_bad_rank_exits_with_a_clear_error() -> None:
    flags = ["--tp-size", "2", "--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "127.0.0.1:5000"]
    command = [sys.executable, "-m", "radixserve.launch_server", *flags]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--node-rank must be in 0..1 (--nnodes 2), got 2" in result.stderr
