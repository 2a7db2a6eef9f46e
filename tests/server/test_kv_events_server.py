"""KV cache events from a live server (--kv-events-config on the shared tiny-llama server): a
subscriber sees a request's tokens stored, and a replay from the first batch rebuilds a cache
that starts with AllBlocksCleared and never removes a block it was not told of."""

from __future__ import annotations

import time
from typing import Any

import zmq

from tests.kv_event_client import DECODER, AllBlocksCleared, Batch, BlockStored, follow, replay, stored_paths
from tests.server.conftest import LiveServer

SHARED_SERVER = True


def generate(server: LiveServer, input_ids: list[int]) -> dict[str, Any]:
    with server.client() as client:
        body = {"input_ids": input_ids, "sampling_params": {"temperature": 0.0, "max_new_tokens": 3}}
        reply = client.post("/generate", json=body)
        assert reply.status_code == 200, reply.text
        out: dict[str, Any] = reply.json()
        return out


def test_a_subscriber_sees_the_request_s_tokens_stored(server: LiveServer) -> None:
    assert server.kv_events is not None
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(server.kv_events[0])
    batches: list[Batch] = []
    prompt = [301, 302, 303, 304, 305, 306, 307, 308]
    try:
        # A new subscriber misses what was published before it joined: ask until it has heard.
        deadline = time.monotonic() + 60
        found = False
        while not found and time.monotonic() < deadline:
            generate(server, prompt)
            while sub.poll(500):
                topic, _seq, payload = sub.recv_multipart()
                assert topic == b""
                batches.append(DECODER.decode(payload))
            found = any(path[: len(prompt)] == prompt for path in stored_paths(batches).values())
            prompt = [t + 1 for t in prompt]  # a new prefix each try, so it is stored anew
        assert found, "the request's prefix was never published"
    finally:
        sub.close(linger=0)
    stored = [e for b in batches for e in b.events if isinstance(e, BlockStored)]
    assert all(e.medium == "CPU" and e.block_size == 1 and e.lora_id is None for e in stored)
    info = server.server_info()
    assert info["kv_events_endpoint"] == server.kv_events[0]
    assert info["kv_events_published"] >= len(batches) and info["kv_events_dropped"] == 0


def test_a_replay_from_the_first_batch_rebuilds_a_consistent_cache(server: LiveServer) -> None:
    assert server.kv_events is not None
    generate(server, [400, 401, 402, 403])
    replayed = replay(server.kv_events[1])
    sequence, batches = [seq for seq, _ in replayed], [batch for _, batch in replayed]
    assert sequence == list(range(len(sequence))) and sequence, "replay from 0 starts at 0, no gaps"
    assert isinstance(batches[0].events[0], AllBlocksCleared)  # the server's cache starts empty
    assert all(batch.data_parallel_rank == 0 for batch in batches)
    blocks = follow(batches)
    paths = stored_paths(batches)
    assert any(paths[h][:4] == [400, 401, 402, 403] for h in blocks["CPU"]), "the request's prefix is cached"
