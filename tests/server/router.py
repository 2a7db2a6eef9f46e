"""`python -m sglang_router.launch_router` (PyPI sglang-router, a test dependency) on 127.0.0.1."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from tests.ports import free_port


@contextlib.contextmanager
def launch_router(router_args: list[str], log_path: Path, healthy_workers: int) -> Iterator[str]:
    """The router with these arguments (its workers and policy), once it lists that many healthy
    workers; its base URL. Stopped on exit."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
        *router_args, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
        "--log-level", "warn",
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, log_path.read_text(errors="replace")
            try:
                workers = httpx.get(f"{base}/workers", timeout=2).json()
                if sum(1 for w in workers.get("workers", []) if w.get("is_healthy")) == healthy_workers:
                    break
            except (httpx.TransportError, ValueError):
                pass
            assert time.monotonic() < deadline, log_path.read_text(errors="replace")
            time.sleep(0.2)
        yield base
    finally:
        process.terminate()
        process.wait(timeout=30)


def generated_ids(base: str, prompt: list[int], stream: bool, params: dict[str, Any]) -> list[int]:
    """POST /generate with token ids, streaming or not; the output ids."""
    body = {"input_ids": prompt, "sampling_params": params, "stream": stream}
    with httpx.Client(base_url=base, timeout=120) as client:
        if not stream:
            reply = client.post("/generate", json=body)
            assert reply.status_code == 200, reply.text
            ids: list[int] = reply.json()["output_ids"]
            return ids
        last: dict[str, Any] = {}
        with client.stream("POST", "/generate", json=body) as reply:
            assert reply.status_code == 200, reply.read()
            for line in reply.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    last = json.loads(line[len("data: ") :])
        ids = last["output_ids"]
        return ids


def chat_text(base: str, content: str, stream: bool, max_tokens: int) -> str:
    """One greedy user turn through /v1/chat/completions, streaming or not; the reply's text."""
    model = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
    messages = [{"role": "user", "content": content}]
    body = {
        "model": model,
        "messages": messages,
        "stream": stream,
        "temperature": 0.0,
        "max_tokens": max_tokens,
    }
    with httpx.Client(base_url=base, timeout=120) as client:
        if not stream:
            reply = client.post("/v1/chat/completions", json=body)
            assert reply.status_code == 200, reply.text
            text: str = reply.json()["choices"][0]["message"]["content"]
            return text
        parts = []
        with client.stream("POST", "/v1/chat/completions", json=body) as reply:
            assert reply.status_code == 200, reply.read()
            for line in reply.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    delta = json.loads(line[len("data: ") :])["choices"][0]["delta"]
                    parts.append(delta.get("content") or "")
        return "".join(parts)
