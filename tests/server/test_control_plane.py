"""Internal state, load, slow-down, request logging and the watchdog, through the HTTP server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from tests.server.conftest import LiveServer

LONG: dict[str, Any] = {"temperature": 0.0, "max_new_tokens": 300, "ignore_eos": True}


def test_internal_state_limits_running_requests_and_rejects_bad_values(server: LiveServer) -> None:
    with server.client() as client:
        before = client.get("/get_internal_state").json()
        assert "max_running_requests" in before["settable"]
        changed = client.post("/set_internal_state", json={"server_args": {"max_running_requests": 2}})
        assert changed.status_code == 200 and changed.json()["max_running_requests"] == 2
        for bad, message in [
            ({"max_running_requests": 0}, "max_running_requests must be in [1,"),
            ({"max_running_requests": "many"}, "max_running_requests must be int"),
            ({"page_size": 4}, "'page_size' cannot be changed"),
            ({"chunked_prefill_size": 0}, "chunked_prefill_size must be -1"),
        ]:
            refused = client.post("/set_internal_state", json=bad)
            assert refused.status_code == 400 and message in refused.json()["error"]["message"], refused.text
        assert client.get("/get_internal_state").json()["max_running_requests"] == 2

    async def run() -> tuple[int, int]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
            tasks = [
                asyncio.create_task(
                    client.post("/generate", json={"input_ids": [5, 6, i], "sampling_params": LONG})
                )
                for i in range(4)
            ]
            most_running, most_load = 0, 0
            while not all(t.done() for t in tasks):
                info = (await client.get("/get_server_info")).json()
                load = (await client.get("/get_load")).json()
                most_running = max(most_running, info["num_running_reqs"])
                most_load = max(most_load, sum(rank["num_reqs"] for rank in load))
                await asyncio.sleep(0.02)
            responses = [await t for t in tasks]
            assert all(r.status_code == 200 for r in responses)
            return most_running, most_load

    try:
        most_running, most_load = asyncio.run(run())
        assert most_running == 2 and most_load >= 3
    finally:
        with server.client() as client:
            restore = {"max_running_requests": before["max_running_requests"]}
            assert client.post("/set_internal_state", json=restore).status_code == 200


def test_configure_logging_logs_each_request(
    tiny_model_dir: Callable[[str], Path], start_server: Any
) -> None:
    live = start_server(tiny_model_dir("llama"), "--log-level", "info")
    with live.client() as client:
        assert client.post("/configure_logging", json={"log_requests": "yes"}).status_code == 400
        assert client.post("/configure_logging", json={"log_requests": True}).json() == {"log_requests": True}
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}, "rid": "logged-1"}
        assert client.post("/generate", json=body).status_code == 200
    deadline = time.monotonic() + 5
    while "request logged-1 finished" not in live.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "request logged-1: 3 prompt tokens" in live.log()
    assert "request logged-1 finished" in live.log()


def test_watchdog_stops_a_stuck_server(tiny_model_dir: Callable[[str], Path], start_server: Any) -> None:
    live = start_server(tiny_model_dir("llama"), "--watchdog-timeout", "1")
    with live.client() as client:
        assert client.post("/slow_down", json={"forward_sleep_time": -1}).status_code == 400
        assert client.post("/slow_down", json={"forward_sleep_time": 4}).status_code == 200
        # The server goes away mid-request, as it should.
        with contextlib.suppress(httpx.TransportError):
            body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}
            client.post("/generate", json=body, timeout=15)
    code = live.process.wait(timeout=20)
    assert code != 0
    log = live.log()
    assert "watchdog: a forward step has run for more than 1.0s" in log
    assert "most recent call first" in log  # the stack dump
    assert "the scheduler process exited with code 3" in log
    live.assert_no_ipc_files()


def test_profiler_writes_a_chrome_trace(server: LiveServer, tmp_path: Path) -> None:
    with server.client() as client:
        assert client.post("/stop_profile").status_code == 400  # not running
        trace = client.post("/start_profile", json={"output_dir": str(tmp_path), "num_steps": 3}).json()[
            "trace"
        ]
        assert client.post("/start_profile", json={"output_dir": str(tmp_path)}).status_code == 400
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}}
        assert client.post("/generate", json=body).status_code == 200
        # Three forward steps stopped it by itself; a manual start/stop writes a second trace.
        manual = client.post("/start_profile", json={"output_dir": str(tmp_path)}).json()["trace"]
        assert client.post("/generate", json=body).status_code == 200
        assert client.post("/stop_profile").json()["trace"] == manual
        staged = {"output_dir": str(tmp_path), "num_steps": 2, "profile_by_stage": True}
        assert client.post("/start_profile", json={**staged, "num_steps": None}).status_code == 400
        stages = client.post("/start_profile", json=staged).json()
        assert set(stages) == {"prefill", "decode"}
        # Two prompts arriving apart make two prefill batches; two decode steps end the other trace.
        for prompt in ([5, 6, 8], [5, 6, 9]):
            assert client.post("/generate", json={**body, "input_ids": prompt}).status_code == 200
        assert client.post("/stop_profile").status_code == 400  # both stopped by themselves
    for path in (trace, manual, stages["prefill"], stages["decode"]):
        events = json.loads(Path(path).read_text())["traceEvents"]
        assert events, path


def test_sessions_over_http(server: LiveServer) -> None:
    with server.client() as client:
        session = client.post("/open_session", json={"session_id": "http-chat"}).json()
        assert session == "http-chat"
        assert client.post("/open_session", json={"session_id": "http-chat"}).status_code == 400
        params = {"max_new_tokens": 3, "temperature": 0.0}
        first = client.post(
            "/generate",
            json={"input_ids": [5, 6], "sampling_params": params, "session_params": {"id": session}},
        ).json()
        second = client.post(
            "/generate", json={"input_ids": [7], "sampling_params": params, "session_params": {"id": session}}
        ).json()
        assert second["meta_info"]["prompt_tokens"] == 2 + len(first["output_ids"]) + 1
        assert client.post("/close_session", json={"session_id": session}).status_code == 200
        closed = client.post(
            "/generate", json={"input_ids": [7], "sampling_params": params, "session_params": {"id": session}}
        )
        assert closed.status_code == 400 and "is not open" in closed.json()["error"]["message"]


def test_a_data_parallel_server(tiny_model_dir: Any, start_server: Any) -> None:
    live = start_server(tiny_model_dir("llama"), "--dp-size", "2", "--load-balance-method", "shortest_queue")
    with live.client() as client:
        body = {"input_ids": [[5, 6, i] for i in range(8)], "sampling_params": {"max_new_tokens": 4}}
        results = client.post("/generate", json=body).json()
        assert [r["meta_info"]["completion_tokens"] for r in results] == [4] * 8
        info = live.server_info()
        assert len(info["dp_replicas"]) == 2 and info["dp_size"] == 2
        assert all(r["generated_tokens"] > 0 for r in info["dp_replicas"])
        assert client.get("/get_load").status_code == 200
    # finish(): both replicas idle with their KV intact, then a clean stop with no process left.


def test_server_info_names_the_attention_backend_and_decode_path(
    tiny_model_dir: Callable[[str], Path], start_server: Any
) -> None:
    live = start_server(tiny_model_dir("llama"), "--attention-backend", "torch_native", "--log-level", "info")
    with live.client() as client:
        info = client.get("/get_server_info").json()
    assert info["attention_backend"] == "torch_native"
    assert info["attention_backend_reason"] == "asked for with --attention-backend"
    assert info["decode_path"].startswith("torch SDPA over length buckets")
    reason = "asked for with --attention-backend"
    assert f"attention backend: torch_native ({reason}); decode path: {info['decode_path']}" in live.log()
