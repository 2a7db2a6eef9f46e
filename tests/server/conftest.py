"""Live servers for end-to-end tests: `python -m radixserve.launch_server` on 127.0.0.1 and a free port.

Every server a test starts must, at the end, be idle with its KV accounting intact (as
/get_server_info reports), stop cleanly on SIGTERM, and leave no child process and no socket file.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.ports import free_port

STARTUP_TIMEOUT_S = 120


def child_pids(pid: int) -> list[int]:
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            # The parent pid is the 2nd field after the parenthesized command name.
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                children.append(int(entry))
    return children


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@dataclass
class LiveServer:
    process: subprocess.Popen[bytes]
    base_url: str
    log_path: Path
    tmp_dir: Path
    api_key: str | None = None
    # The KV cache events' PUB and replay endpoints, where --kv-events-config set them.
    kv_events: tuple[str, str] | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def openai(self) -> openai.OpenAI:
        """The official client, with this server's key (if any) and no retries."""
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=self.api_key or "none", max_retries=0)

    def client(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers=self.headers, timeout=120, **kwargs)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not ready within {STARTUP_TIMEOUT_S}s:\n{self.log()}")

    def server_info(self) -> dict[str, Any]:
        with self.client() as client:
            response = client.get("/get_server_info")
            response.raise_for_status()
            info: dict[str, Any] = response.json()
            return info

    def assert_idle_and_kv_intact(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        info = self.server_info()
        while not info["idle"] and time.monotonic() < deadline:
            time.sleep(0.1)
            info = self.server_info()
        assert info["idle"], f"server still busy: {info}"
        assert info["kv_invariant"] == "ok", info["kv_invariant"]

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """SIGTERM (or Ctrl-C's SIGINT); the server must exit 0 and leave nothing behind."""
        children = child_pids(self.process.pid)
        self.process.send_signal(sig)
        try:
            code = self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise
        assert code == 0, f"server exited with {code}:\n{self.log()[-3000:]}"
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(pid) for pid in children), "child processes outlived the server"
        self.assert_no_ipc_files()

    def assert_no_ipc_files(self) -> None:
        leftovers = [p.name for p in self.tmp_dir.iterdir() if p.name.startswith("radixserve-")]
        assert not leftovers, f"IPC files left behind: {leftovers}"


def launch(
    model_path: Path | str | None, tmp_dir: Path, *flags: str, api_key: str | None = None
) -> LiveServer:
    """Starts a server on a free port; model_path None serves the default (packaged SmolLM2) model."""
    port = free_port()
    tmp_dir.mkdir(parents=True, exist_ok=True)
    log_path = tmp_dir / "server.log"
    cmd = [
        sys.executable, "-m", "radixserve.launch_server",
        *(["--model-path", str(model_path)] if model_path is not None else []),
        "--port", str(port), "--dtype", "float32", "--max-total-tokens", "16384", "--log-level", "warning",
        *flags,
    ]  # fmt: skip
    if api_key is not None:
        cmd += ["--api-key", api_key]
    # The server's IPC directory goes under tmp_dir, so the test can see that it is removed.
    env = {**os.environ, "TMPDIR": str(tmp_dir)}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = LiveServer(process, f"http://127.0.0.1:{port}", log_path, tmp_dir, api_key)
    try:
        server.wait_ready()
    except BaseException:
        process.kill()
        process.wait()
        raise
    return server


def finish(server: LiveServer) -> None:
    try:
        if server.process.poll() is None:
            server.assert_idle_and_kv_intact()
    finally:
        if server.process.poll() is None:
            server.stop()


@pytest.fixture(scope="module")
def server(
    request: pytest.FixtureRequest,
    tiny_model_dir: Callable[[str], Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[LiveServer]:
    """One tiny-llama server shared by a test module; by every module that sets SHARED_SERVER = True
    (modules that only send requests, never a call that changes the server's state): a server
    start is ~10 s of a 2-core CI machine."""
    if getattr(request.module, "SHARED_SERVER", False):
        shared: LiveServer = request.getfixturevalue("session_server")
        yield shared
        shared.assert_idle_and_kv_intact()  # after each module, so a leak names its module
        return
    live = launch(tiny_model_dir("llama"), tmp_path_factory.mktemp("server"))
    yield live
    finish(live)


@pytest.fixture(scope="session")
def session_server(
    tiny_model_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    """The tiny-llama server of the SHARED_SERVER modules, checked and stopped at the session's end.
    It publishes KV cache events (tests/server/test_kv_events_server.py), so every shared module's
    traffic goes through the event recording too."""
    endpoints = (f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")
    # Replay keeps every batch of the session, so a test can rebuild the cache from the first one.
    config = json.dumps(
        {"endpoint": endpoints[0], "replay_endpoint": endpoints[1], "buffer_steps": 1_000_000}
    )
    live = launch(
        tiny_model_dir("llama"), tmp_path_factory.mktemp("session-server"), "--kv-events-config", config
    )
    live.kv_events = endpoints
    yield live
    finish(live)


@pytest.fixture(scope="module")
def embed_server(minilm_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A server of the packaged all-MiniLM-L6-v2 embedding model, shared by a test module."""
    live = launch(minilm_path, tmp_path_factory.mktemp("embed-server"))
    yield live
    finish(live)


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Callable[..., LiveServer]]:
    """Servers with their own flags, for one test."""
    servers: list[LiveServer] = []

    def start(model_path: Path | str | None, *flags: str, api_key: str | None = None) -> LiveServer:
        live = launch(model_path, tmp_path / f"server{len(servers)}", *flags, api_key=api_key)
        servers.append(live)
        return live

    yield start
    for live in servers:
        finish(live)
