"""Process supervision: a dead child stops the server fast, a dead server stops its children, and
Ctrl-C / SIGTERM shut everything down cleanly."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.server.conftest import LiveServer, alive, child_pids


def child_named(pid: int, module: str) -> int:
    for child in child_pids(pid):
        if module in Path(f"/proc/{child}/cmdline").read_text().replace("\0", " "):
            return child
    raise AssertionError(f"no {module} child of {pid}")


def kill_and_expect_a_fast_nonzero_exit(live: LiveServer, victim: int) -> None:
    """SIGKILL one child: the server exits non-zero within 5 s, says why, and leaves no process
    (the others are polled, with a bound) and no IPC file behind."""
    children = child_pids(live.process.pid)
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    code = live.process.wait(timeout=10)
    assert time.monotonic() - killed_at < 5
    assert code != 0
    assert "killed by SIGKILL" in live.log()
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in children), "a process outlived the server"
    live.assert_no_ipc_files()


@pytest.mark.parametrize("victim", ["radixserve.scheduler.process", "radixserve.runtime.detokenizer"])
def test_a_killed_child_makes_the_server_exit_nonzero_fast(
    tiny_model_dir: Callable[[str], Path], start_server: Any, victim: str
) -> None:
    live = start_server(tiny_model_dir("llama"), "--log-level", "info")
    assert "KV cache holds 16384 tokens" in live.log()
    kill_and_expect_a_fast_nonzero_exit(live, child_named(live.process.pid, victim))


def test_children_exit_when_the_server_is_killed(
    tiny_model_dir: Callable[[str], Path], start_server: Any
) -> None:
    live = start_server(tiny_model_dir("llama"))
    children = child_pids(live.process.pid)
    assert len(children) == 2
    live.process.kill()
    live.process.wait()
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in children)


def test_ctrl_c_shuts_down_cleanly(tiny_model_dir: Callable[[str], Path], start_server: Any) -> None:
    live = start_server(tiny_model_dir("llama"))
    with live.client() as client:
        assert client.post(
            "/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}
        ).is_success
    live.assert_idle_and_kv_intact()
    live.stop(signal.SIGINT)  # exit code 0, no child left, no socket file left


@pytest.mark.parametrize(
    ("flags", "rank_flag"), [(["--tp-size", "2"], "--rank 1"), (["--dp-size", "2"], "--dp-rank 1")]
)
def test_a_killed_rank_or_replica_makes_the_server_exit_nonzero_fast(
    tiny_model_dir: Callable[[str], Path], start_server: Any, flags: list[str], rank_flag: str
) -> None:
    """One tensor-parallel rank or one data-parallel replica of several dies: the server must not
    go on half-alive (its peers would wait on it forever); it exits within seconds, non-zero."""
    live = start_server(tiny_model_dir("llama"), *flags, "--log-level", "info")
    victim = next(
        pid
        for pid in child_pids(live.process.pid)
        if rank_flag in Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    )
    kill_and_expect_a_fast_nonzero_exit(live, victim)
