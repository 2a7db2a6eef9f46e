"""/dashboard behind a live server: off unless --enable-dashboard; behind --api-key (a bearer
header, or the cookie that /dashboard?api_key= sets, which no other route accepts); snapshots
that follow a workload (totals, recent requests, KV split, the radix tree with hits); the event
stream."""

from __future__ import annotations

import json
import re
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import httpx

from tests.engine.oracle import random_prompts
from tests.server.conftest import LiveServer

KEY = "dash-key"
PARAMS = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}


def test_off_by_default(
    start_server: Callable[..., LiveServer], tiny_model_dir: Callable[[str], Path]
) -> None:
    server = start_server(tiny_model_dir("llama"))
    with server.client() as client:
        for path in ("/dashboard", "/dashboard/snapshot", "/dashboard/events"):
            assert client.get(path).status_code == 404
        # A short model id, not the checkpoint's path; serve printed where it is and a request to paste.
        (model,) = client.get("/v1/models").json()["data"]
        assert model["id"] == tiny_model_dir("llama").name
    log = server.log_path.read_text()
    assert f"radixserve is ready at {server.base_url}" in log
    assert f"curl {server.base_url}/v1/chat/completions" in log and "dashboard:" not in log


def test_snapshots_follow_the_workload(
    start_server: Callable[..., LiveServer], tiny_model_dir: Callable[[str], Path]
) -> None:
    server = start_server(tiny_model_dir("llama"), "--enable-dashboard", api_key=KEY)
    shared = random_prompts(1, [40], seed=70)[0]
    with server.client() as client:  # sends the bearer header
        for tail in random_prompts(4, [8] * 4, seed=71):
            client.post(
                "/generate", json={"input_ids": shared + tail, "sampling_params": PARAMS}
            ).raise_for_status()
        snap = client.get("/dashboard/snapshot").json()
    assert snap["totals"]["requests"] == 4 and snap["totals"]["output_tokens"] == 24
    assert snap["totals"]["cached_tokens"] >= 3 * 40
    assert len(snap["recent"]) == 4 and all(r["state"] == "finished" for r in snap["recent"])
    assert all(r["ttft_ms"] is not None and r["e2e_ms"] >= r["ttft_ms"] for r in snap["recent"])
    assert snap["latency"]["ttft_ms"]["count"] == 4 and snap["latency"]["itl_ms"]["count"] == 4 * 5
    (replica,) = snap["replicas"]
    kv = replica["kv"]
    assert kv["running"] == 0 and kv["cached"] + kv["free"] == kv["total"] and kv["cached"] > 0
    tree = replica["radix_tree"]
    assert tree["total_tokens"] == kv["cached"]
    (branch,) = tree["children"]  # the shared prefix, then one branch per tail
    assert branch["tokens"] == 40 and branch["hits"] == 3 and len(branch["children"]) == 4
    assert isinstance(branch["text"], str) and branch["text"]


def test_api_key_and_cookie(
    start_server: Callable[..., LiveServer], tiny_model_dir: Callable[[str], Path]
) -> None:
    server = start_server(tiny_model_dir("llama"), "--enable-dashboard", api_key=KEY)
    assert f"dashboard: {server.base_url}/dashboard?api_key=<your --api-key>" in server.log_path.read_text()
    assert KEY not in server.log_path.read_text()
    with httpx.Client(base_url=server.base_url, timeout=30) as anonymous:
        assert anonymous.get("/dashboard").status_code == 401
        assert anonymous.get("/dashboard/events").status_code == 401
        assert anonymous.get("/dashboard?api_key=wrong").status_code == 401
        opened = anonymous.get(f"/dashboard?api_key={KEY}", follow_redirects=False)
        assert opened.status_code == 303 and opened.headers["location"] == "/dashboard"
        assert "httponly" in opened.headers["set-cookie"].lower()
        # The client now holds the cookie: the page and its feed answer, other routes do not.
        page = anonymous.get("/dashboard")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        # Self-contained: nothing is loaded from elsewhere (the SVG namespace URI is only a name).
        assert "<script" in page.text and not re.search(
            r"""(src|href)\s*=\s*(?!["']?data:)|@import|url\(\s*(?!["']?data:)""", page.text
        )
        assert anonymous.get("/dashboard/snapshot").status_code == 200
        assert anonymous.get("/get_server_info").status_code == 401
        with anonymous.stream("GET", "/dashboard/events") as stream:
            assert stream.headers["content-type"].startswith("text/event-stream")
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            second = next(line for line in lines if line.startswith("data: "))
    assert json.loads(first[6:])["model"] and json.loads(second[6:])["time"] >= json.loads(first[6:])["time"]


def test_an_open_dashboard_does_not_hold_shutdown(
    start_server: Callable[..., LiveServer], tiny_model_dir: Callable[[str], Path]
) -> None:
    """An event stream never ends by itself: shutdown ends it, instead of waiting out the grace
    period (600 s here, far beyond the bound below)."""
    server = start_server(tiny_model_dir("llama"), "--enable-dashboard", "--graceful-shutdown-timeout", "600")
    server.assert_idle_and_kv_intact()
    opened, ended = threading.Event(), threading.Event()

    def watch() -> None:
        try:
            client = httpx.Client(base_url=server.base_url, timeout=None)
            with client, client.stream("GET", "/dashboard/events") as stream:
                for line in stream.iter_lines():
                    if line.startswith("data: "):
                        opened.set()
        finally:
            ended.set()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    assert opened.wait(timeout=60)  # the stream is open: its first snapshot came
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(timeout=120) == 0
    assert ended.wait(timeout=30)
