"""SIGTERM drains the requests in flight, then aborts what is left with a clear finish reason;
--request-timeout aborts a request that runs too long with a 503. Every forward step sleeps (the
/slow_down hook), so that "still running" depends on step counts, never on the machine's speed."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from tests.server.conftest import LiveServer

STEP_SLEEP_S = 0.05


def stream_generate(live: LiveServer, max_new_tokens: int, chunks: list[dict[str, Any]]) -> threading.Thread:
    """Streams a /generate in a thread, appending every chunk it receives."""

    def run() -> None:
        body = {
            "input_ids": [5, 6, 7],
            "stream": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True, "temperature": 0},
        }
        with live.client() as client, client.stream("POST", "/generate", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[len("data: ") :]))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def wait_for(condition: Callable[[], bool], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def refuses_connections(live: LiveServer) -> bool:
    try:
        httpx.get(f"{live.base_url}/health", timeout=1)
    except httpx.TransportError:
        return True
    return False


def test_sigterm_lets_requests_in_flight_finish(
    tiny_model_dir: Callable[[str], Path], start_server: Any
) -> None:
    live = start_server(tiny_model_dir("llama"), "--graceful-shutdown-timeout", "120")
    with live.client() as client:
        assert client.post("/slow_down", json={"forward_sleep_time": STEP_SLEEP_S}).status_code == 200
    chunks: list[dict[str, Any]] = []
    thread = stream_generate(live, 40, chunks)
    wait_for(lambda: len(chunks) > 0)
    live.process.send_signal(signal.SIGTERM)
    wait_for(lambda: refuses_connections(live))  # no new connection, while the stream goes on
    thread.join(timeout=120)
    assert not thread.is_alive()
    final = chunks[-1]
    assert final["meta_info"]["finish_reason"]["type"] == "length"
    assert len(final["output_ids"]) == 40
    assert live.process.wait(timeout=60) == 0


def test_sigterm_aborts_what_outlives_the_grace_period(
    tiny_model_dir: Callable[[str], Path], start_server: Any
) -> None:
    live = start_server(tiny_model_dir("llama"), "--graceful-shutdown-timeout", "1", "--log-level", "info")
    with live.client() as client:
        assert client.post("/slow_down", json={"forward_sleep_time": STEP_SLEEP_S}).status_code == 200
    # 900 steps of at least 50 ms: far longer than the 1 s grace period on any machine.
    chunks: list[dict[str, Any]] = []
    thread = stream_generate(live, 900, chunks)
    answer: list[httpx.Response] = []

    def post() -> None:
        body = {"input_ids": [9, 10], "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}
        with live.client() as client:
            answer.append(client.post("/generate", json=body))

    poster = threading.Thread(target=post, daemon=True)
    poster.start()
    wait_for(lambda: len(chunks) > 0 and live.server_info()["num_running_reqs"] == 2)
    live.stop()  # SIGTERM; exit code 0, no child process or IPC file left
    thread.join(timeout=30)
    poster.join(timeout=30)
    assert not thread.is_alive() and not poster.is_alive()
    for finish in (chunks[-1]["meta_info"]["finish_reason"], answer[0].json()["meta_info"]["finish_reason"]):
        assert finish["type"] == "abort"
        assert "shutting down" in finish["message"]
    assert answer[0].status_code == 200
    assert len(chunks[-1]["output_ids"]) < 900
    assert "aborting 2 requests still running after --graceful-shutdown-timeout 1 s" in live.log()


def test_request_timeout_aborts_with_a_503(tiny_model_dir: Callable[[str], Path], start_server: Any) -> None:
    live = start_server(tiny_model_dir("llama"), "--request-timeout", "1")
    with live.client() as client:
        assert client.post("/slow_down", json={"forward_sleep_time": STEP_SLEEP_S}).status_code == 200
        long = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}
        response = client.post("/generate", json=long)
        assert response.status_code == 503
        error = response.json()["error"]
        assert "--request-timeout" in error["message"]
        model = client.get("/v1/models").json()["data"][0]["id"]
        completion = client.post(
            "/v1/completions", json={"model": model, "prompt": [5, 6], "max_tokens": 900, "ignore_eos": True}
        )
        assert completion.status_code == 503
        # A streamed request that times out ends its stream with the error event.
        chunks: list[dict[str, Any]] = []
        body = {**long, "stream": True}
        with client.stream("POST", "/generate", json=body) as stream:
            for line in stream.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[len("data: ") :]))
        assert "--request-timeout" in chunks[-1]["error"]["message"]
        assert client.post("/slow_down", json={"forward_sleep_time": None}).status_code == 200
        short = client.post("/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 4}})
        assert short.status_code == 200 and len(short.json()["output_ids"]) == 4
    live.assert_idle_and_kv_intact()
    assert live.server_info()["aborted_reqs"] == 3
