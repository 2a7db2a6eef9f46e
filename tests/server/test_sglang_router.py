"""Two radixserve replicas behind sglang-router (PyPI, a test dependency), all on 127.0.0.1: the
router finds both, mixed streaming and non-streaming traffic through it (native and OpenAI
routes) gets the outputs the replicas give directly, both replicas serve, and a client that hangs
up mid-stream aborts its request on the replica that ran it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.conftest import LiveServer, finish, launch
from tests.server.router import chat_text, generated_ids, launch_router

SHARED_SERVER = True  # replica A; replica B is a server of this module's own
GREEDY = {"temperature": 0.0, "max_new_tokens": 6}


@pytest.fixture(scope="module")
def replicas(
    server: LiveServer, tiny_model_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LiveServer, LiveServer]]:
    other = launch(tiny_model_dir("llama"), tmp_path_factory.mktemp("replica-b"))
    yield server, other
    finish(other)


def _router(replicas: tuple[LiveServer, LiveServer], policy: str, log_path: Path) -> Any:
    """The router in front of the replicas, once it has registered both as healthy workers."""
    urls = [replica.base_url for replica in replicas]
    return launch_router(["--worker-urls", *urls, "--policy", policy], log_path, healthy_workers=2)


@pytest.fixture(scope="module")
def router(
    replicas: tuple[LiveServer, LiveServer], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    with _router(replicas, "cache_aware", tmp_path_factory.mktemp("router") / "router.log") as base:
        yield base


def _generated(replica: LiveServer) -> int:
    tokens: int = replica.server_info()["generated_tokens"]
    return tokens


def _native(base: str, prompt: list[int], stream: bool) -> list[int]:
    return generated_ids(base, prompt, stream, GREEDY)


def _chat(base: str, content: str, stream: bool) -> str:
    return chat_text(base, content, stream, max_tokens=6)


def test_mixed_traffic_through_the_router_matches_the_replicas_and_reaches_both(
    router: str, replicas: tuple[LiveServer, LiveServer]
) -> None:
    before = [_generated(replica) for replica in replicas]
    prompts = [[11 + i, 40 + 3 * i, 7, 90 + i, 5 * i + 1] for i in range(8)]
    jobs: list[tuple[str, Any, bool]] = [("native", p, i % 2 == 0) for i, p in enumerate(prompts)]
    jobs += [("chat", f"Question {i}: what comes next?", i % 2 == 0) for i in range(4)]

    def run(base: str, job: tuple[str, Any, bool]) -> Any:
        kind, prompt, stream = job
        return _native(base, prompt, stream) if kind == "native" else _chat(base, prompt, stream)

    with ThreadPoolExecutor(6) as pool:
        routed = list(pool.map(lambda job: run(router, job), jobs))
    direct = [run(replicas[1].base_url, job) for job in jobs]
    assert routed == direct  # greedy fp32, one model: any replica gives the same
    served = [_generated(replica) - was for replica, was in zip(replicas, before, strict=True)]
    assert all(tokens > 0 for tokens in served), f"both replicas serve: {served}"
    for replica in replicas:
        replica.assert_idle_and_kv_intact()


def test_a_client_hanging_up_through_the_router_aborts_on_the_replica(
    router: str, replicas: tuple[LiveServer, LiveServer]
) -> None:
    aborted = [replica.server_info()["aborted_reqs"] for replica in replicas]
    long = {"temperature": 0.0, "max_new_tokens": 900, "ignore_eos": True}
    body = {"input_ids": [3, 1, 4, 1, 5, 9, 2, 6], "sampling_params": long, "stream": True}
    with (
        httpx.Client(base_url=router, timeout=120) as client,
        client.stream("POST", "/generate", json=body) as reply,
    ):
        assert reply.status_code == 200
        chunks = 0
        for line in reply.iter_lines():
            chunks += line.startswith("data: ")
            if chunks >= 3:
                break  # hang up mid-stream
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        now = [replica.server_info()["aborted_reqs"] for replica in replicas]
        if sum(now) > sum(aborted):
            break
        time.sleep(0.2)
    assert sum(now) == sum(aborted) + 1, "the hang-up reached the replica as an abort"
    for replica in replicas:
        replica.assert_idle_and_kv_intact()


def test_flush_cache_and_load_reports_through_the_router(
    router: str, replicas: tuple[LiveServer, LiveServer]
) -> None:
    for replica in replicas:  # something cached on both
        _native(replica.base_url, [21, 22, 23, 24, 25, 26, 27, 28], stream=False)
        assert replica.server_info()["evictable_tokens"] > 0
    # The router asks every worker's /get_load and lists what each said.
    loads = httpx.get(f"{router}/get_loads", timeout=30)
    assert loads.status_code == 200, loads.text
    reported = {entry["worker"]: entry["load"] for entry in loads.json()["workers"]}
    # -1 is the router's "could not read it"; idle replicas report 0 tokens.
    assert reported == {replica.base_url: 0 for replica in replicas}, reported
    # POST /flush_cache on the router flushes every worker's radix cache.
    flushed = httpx.post(f"{router}/flush_cache", timeout=60)
    assert flushed.status_code == 200, flushed.text
    for replica in replicas:
        replica.assert_idle_and_kv_intact()
        assert replica.server_info()["evictable_tokens"] == 0


@pytest.mark.parametrize("policy", ["round_robin", "power_of_two", "random"])
def test_other_routing_policies_reach_both_replicas_with_the_same_outputs(
    policy: str, replicas: tuple[LiveServer, LiveServer], tmp_path: Path
) -> None:
    prompts = [[31 + i, 8, 60 + 2 * i, 3, 7 * i + 2] for i in range(8)]
    direct = [_native(replicas[0].base_url, p, stream=False) for p in prompts]
    before = [_generated(replica) for replica in replicas]
    with _router(replicas, policy, tmp_path / "router.log") as base, ThreadPoolExecutor(4) as pool:
        routed = list(pool.map(lambda p: _native(base, p, stream=bool(p[0] % 2)), prompts))
    assert routed == direct
    served = [_generated(replica) - was for replica, was in zip(replicas, before, strict=True)]
    if policy == "round_robin":
        assert all(tokens > 0 for tokens in served), f"both replicas serve: {served}"
    assert sum(served) >= len(prompts)
    for replica in replicas:
        replica.assert_idle_and_kv_intact()
