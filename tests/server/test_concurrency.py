"""Many clients at once, and clients that leave early, against a live tiny-llama server."""

from __future__ import annotations

import asyncio
import json
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

    async def drop_waiting(i: int) -> None:
        # A non-streaming client that gives up while its request is in flight.
        async with httpx.AsyncClient(base_url=server.base_url, timeout=0.5) as client:
            try:
                await client.post("/generate", json={"input_ids": prompt_ids(i), "sampling_params": LONG})
            except httpx.TimeoutException:
                return
            raise AssertionError("the request finished before the client gave up")

    async def run() -> list[int]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
            dropped = await asyncio.gather(*(drop_stream(client, i) for i in range(16)))
        await asyncio.gather(*(drop_waiting(100 + i) for i in range(4)))
        return list(dropped)

    assert asyncio.run(run()) == [2] * 16
    server.assert_idle_and_kv_intact()
    assert server.server_info()["aborted_reqs"] - before == 20
    with server.client() as client:
        ok = client.post("/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 3}})
        assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 3
