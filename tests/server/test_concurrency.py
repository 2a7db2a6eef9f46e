"""Many clients at once, and clients that leave early, against a live tiny-llama server."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import httpx

from tests.server.conftest import LiveServer

LONG: dict[str, Any] = {"temperature": 0.0, "max_new_tokens": 900, "ignore_eos": True}


def prompt_ids(i: int) -> list[int]:
    # Different lengths, and some shared prefixes so the radix cache is exercised too.
    return [11 + (i % 4)] * (3 + i % 5) + [20 + i, 30 + (i * 7) % 50]


def test_64_concurrent_streams_match_the_same_prompts_run_alone(server: LiveServer) -> None:
    requests = [
        {
            "input_ids": prompt_ids(i),
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 4 + (i * 5) % 37},
        }
        for i in range(64)
    ]
    with server.client() as client:
        alone = [client.post("/generate", json=r).json()["output_ids"] for r in requests]

    async def stream_one(client: httpx.AsyncClient, body: dict[str, Any]) -> list[int]:
        last: dict[str, Any] = {}
        async with client.stream("POST", "/generate", json={**body, "stream": True}) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    last = json.loads(line[6:])
        assert last["meta_info"]["finish_reason"]["type"] in ("length", "stop")
        ids: list[int] = last["output_ids"]
        return ids

    async def run() -> list[list[int]]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as client:
            return list(await asyncio.gather(*(stream_one(client, r) for r in requests)))

    together = asyncio.run(run())
    assert together == alone
    server.assert_idle_and_kv_intact()


def test_clients_that_disconnect_abort_their_requests(server: LiveServer) -> None:
    """Clients that leave while their requests run: each request is aborted and its KV released.
    The clients leave on events (a streamed token; the scheduler reporting the request running),
    never after a set time, and every forward step sleeps (the /slow_down hook) so that 900 tokens
    take far longer than leaving does, however fast the machine."""
    before = server.server_info()["aborted_reqs"]

    async def drop_stream(client: httpx.AsyncClient, i: int) -> int:
        chunks = 0
        body = {"input_ids": prompt_ids(i), "sampling_params": LONG, "stream": True}
        async with client.stream("POST", "/generate", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    chunks += 1
                    if chunks == 2:
                        break  # leaving the block closes the connection mid-stream
        return chunks

    async def streams() -> list[int]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
            return list(await asyncio.gather(*(drop_stream(client, i) for i in range(16))))

    async def all_running(count: int) -> None:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
            for _ in range(1200):
                response = await client.get("/get_server_info")
                response.raise_for_status()
                if response.json()["num_running_reqs"] >= count:
                    return
                await asyncio.sleep(0.05)
        raise AssertionError(f"{count} requests never ran at once")

    async def drop_waiting(i: int, running: asyncio.Task[None]) -> None:
        # A non-streaming client that gives up once its request runs: cancelling the POST closes
        # its connection.
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
            body = {"input_ids": prompt_ids(i), "sampling_params": LONG}
            post = asyncio.create_task(client.post("/generate", json=body))
            await asyncio.wait({post, running}, return_when=asyncio.FIRST_COMPLETED)
            if post.done():
                raise AssertionError(f"the request finished before the client gave up: {post.result()}")
            running.result()  # the requests were seen running
            post.cancel()
            await asyncio.gather(post, return_exceptions=True)

    async def waiting() -> None:
        running = asyncio.create_task(all_running(4))
        try:
            await asyncio.gather(*(drop_waiting(100 + i, running) for i in range(4)))
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)

    with server.client() as client:
        assert client.post("/slow_down", json={"forward_sleep_time": 0.05}).status_code == 200
    try:
        assert asyncio.run(streams()) == [2] * 16
        server.assert_idle_and_kv_intact()
        assert server.server_info()["aborted_reqs"] - before == 16
        asyncio.run(waiting())
        server.assert_idle_and_kv_intact()
        assert server.server_info()["aborted_reqs"] - before == 20
    finally:
        with server.client() as client:
            assert client.post("/slow_down", json={"forward_sleep_time": None}).status_code == 200
    with server.client() as client:
        ok = client.post("/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 3}})
        assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 3


def test_health_answers_while_every_stream_waits_on_a_long_step(server: LiveServer) -> None:
    """/health never waits on the scheduler: with 32 streams running and every forward step taking
    3 s (the /slow_down hook), 16 probes sent once a whole step's outputs have arrived all come back
    before the next step's outputs. A probe queued behind the scheduler would come back after them."""
    step_s = 3.0
    streams_n = 32
    arrivals: list[float] = []
    chunks = [0] * streams_n

    async def stream_one(client: httpx.AsyncClient, i: int) -> None:
        # 4 tokens: the step that gives each stream its second one, then the one the probes beat.
        body = {"input_ids": [40 + i, 41], "stream": True, "sampling_params": {**LONG, "max_new_tokens": 4}}
        async with client.stream("POST", "/generate", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.monotonic())
                    chunks[i] += 1

    async def until(condition: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 300
        while not condition():
            assert time.monotonic() < deadline, "the streams stopped producing outputs"
            await asyncio.sleep(0.01)

    async def run() -> tuple[float, float, list[int]]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as client:
            streams = [asyncio.create_task(stream_one(client, i)) for i in range(streams_n)]
            # Every stream running (its prefill may have come in an earlier step than another's);
            # then one more step, which gives each running stream exactly one chunk: once all of
            # them are in, that step's outputs are complete and the next are >= step_s away.
            await until(lambda: min(chunks) >= 1)
            seen = list(chunks)
            await until(lambda: all(c > s for c, s in zip(chunks, seen, strict=True)))
            sent = time.monotonic()
            probes = await asyncio.gather(*(client.get("/health") for _ in range(16)))
            answered = time.monotonic()
            await asyncio.gather(*streams)
            return sent, answered, [p.status_code for p in probes]

    with server.client() as client:
        assert client.post("/slow_down", json={"forward_sleep_time": step_s}).status_code == 200
    try:
        sent, answered, codes = asyncio.run(run())
    finally:
        with server.client() as client:
            assert client.post("/slow_down", json={"forward_sleep_time": None}).status_code == 200
    assert codes == [200] * 16
    assert not [t for t in arrivals if sent <= t <= answered], "a step's outputs came before the probes"
    server.assert_idle_and_kv_intact()
