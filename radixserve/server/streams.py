"""Running several requests for one HTTP call (n choices, list prompts) and watching the client.

Every request of a call runs as its own engine stream; their outputs merge into one async iterator
in arrival order. Whatever ends the iteration early (the client went away, an error) aborts every
request that has not finished, so no KV stays held for a client that is gone.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from fastapi import Request

from radixserve.protocol.messages import GenerateRequest
from radixserve.runtime.engine import Engine, GenerateOutput
from radixserve.server.errors import ApiError

T = TypeVar("T")

# How often a non-streaming call checks whether its client is still connected.
DISCONNECT_POLL_S = 0.25


class ClientDisconnected(Exception):
    """The client closed the connection before the answer was ready."""


def raise_if_refused(state: GenerateOutput) -> None:
    """A request the scheduler refused for the client's fault (an invalid grammar) is an HTTP error."""
    finish = state.finish_reason
    if finish is not None and finish.status_code is not None:
        raise ApiError(finish.status_code, finish.message or "the request was refused")


def merged_stream(
    engine: Engine, reqs: list[GenerateRequest], leaders: list[int | None] | None = None
) -> AsyncIterator[tuple[int, GenerateOutput]]:
    """Submits the requests and returns an iterator of (index in reqs, state snapshot) for every
    output until all finish. A request with a leader (leaders[i] = index of another request with
    the same prompt) is submitted only once its leader produced output: by then the prompt's KV is
    in the radix cache, so n samples of one prompt prefill it once. The others are submitted now,
    so that a refusal raises before any response starts."""
    leaders = leaders or [None] * len(reqs)
    streams: dict[int, AsyncIterator[GenerateOutput]] = {}
    try:
        for index, req in enumerate(reqs):
            if leaders[index] is None:
                streams[index] = engine.stream(req)
    except BaseException:
        # A later request was refused (e.g. the queue is full): the earlier ones must not linger.
        for index in streams:
            engine.abort(reqs[index].rid)
        raise
    followers: dict[int, list[int]] = {}
    for index, leader in enumerate(leaders):
        if leader is not None:
            followers.setdefault(leader, []).append(index)
    return _merge(engine, reqs, streams, followers)


def shared_prompt_leaders(num_prompts: int, n: int) -> list[int | None]:
    """For requests numbered prompt i × n + sample j: sample 0 of each prompt leads the others."""
    return [None if j == 0 else i * n for i in range(num_prompts) for j in range(n)]


async def _merge(
    engine: Engine,
    reqs: list[GenerateRequest],
    streams: dict[int, AsyncIterator[GenerateOutput]],
    followers: dict[int, list[int]],
) -> AsyncIterator[tuple[int, GenerateOutput]]:
    outputs: asyncio.Queue[tuple[int, GenerateOutput | BaseException]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[GenerateOutput]) -> None:
        try:
            async for state in stream:
                # A snapshot: the engine updates the same object with the next output.
                outputs.put_nowait((index, dataclasses.replace(state)))
        except Exception as exc:
            outputs.put_nowait((index, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in streams.items()]
    remaining = len(reqs)
    try:
        while remaining:
            index, item = await outputs.get()
            if isinstance(item, BaseException):
                raise item
            raise_if_refused(item)
            for follower in followers.pop(index, []):
                tasks.append(asyncio.create_task(pump(follower, engine.stream(reqs[follower]))))
            if item.finished:
                remaining -= 1
            yield index, item
    finally:
        # Cancelling a pump closes its stream, which aborts its request if unfinished.
        for task in tasks:
            task.cancel()


async def collect(
    engine: Engine, reqs: list[GenerateRequest], request: Request, leaders: list[int | None] | None = None
) -> list[GenerateOutput]:
    """The final state of every request; aborts them all if the client disconnects meanwhile."""
    for req in reqs:
        req.stream = False  # nothing reads its output before it finishes
    merged = merged_stream(engine, reqs, leaders)

    async def consume() -> list[GenerateOutput]:
        finals: list[GenerateOutput | None] = [None] * len(reqs)
        async for index, state in merged:
            if state.finished:
                finals[index] = state
        return [s for s in finals if s is not None]

    return await until_disconnect(consume(), request)


async def until_disconnect(work: Awaitable[T], request: Request) -> T:
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientDisconnected()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
