"""The native API (/generate and the control routes) against a live tiny-llama server."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from tests.server.conftest import LiveServer

GREEDY: dict[str, Any] = {"temperature": 0.0}
# Long enough that requests are still decoding when the test acts on them.
LONG: dict[str, Any] = {"temperature": 0.0, "max_new_tokens": 900, "ignore_eos": True}


def sse_events(lines: list[str]) -> list[dict[str, Any]]:
    events = []
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[len("data: ") :]))
    return events


def test_generate_single_batch_ids_and_rid(server: LiveServer) -> None:
    with server.client() as client:
        single = client.post(
            "/generate", json={"text": "def main():", "sampling_params": {**GREEDY, "max_new_tokens": 6}}
        ).json()
        assert len(single["output_ids"]) == 6 and isinstance(single["text"], str)
        meta = single["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "matched": None}
        assert meta["completion_tokens"] == 6 and meta["prompt_tokens"] > 0
        assert {"id", "cached_tokens", "e2e_latency"} <= set(meta)

        batch = client.post(
            "/generate",
            json={"text": ["def main():", "import os"], "sampling_params": {**GREEDY, "max_new_tokens": 6}},
        ).json()
        assert isinstance(batch, list) and batch[0]["output_ids"] == single["output_ids"]

        by_ids = client.post(
            "/generate",
            json={
                "input_ids": [5, 6, 7],
                "sampling_params": {**GREEDY, "max_new_tokens": 3},
                "rid": "mine-1",
            },
        ).json()
        assert by_ids["meta_info"]["id"] == "mine-1" and by_ids["meta_info"]["prompt_tokens"] == 3


def test_generate_stream_sends_cumulative_text(server: LiveServer) -> None:
    body = {"text": "def main():", "sampling_params": {**GREEDY, "max_new_tokens": 8}, "stream": True}
    with server.client() as client:
        full = client.post("/generate", json={**body, "stream": False}).json()
        with client.stream("POST", "/generate", json=body) as response:
            lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = sse_events(lines)
    assert events[-1]["text"] == full["text"] and events[-1]["output_ids"] == full["output_ids"]
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    assert len(events) > 1


def test_stop_strings_and_min_tokens_on_the_native_api(server: LiveServer) -> None:
    with server.client() as client:
        free = client.post(
            "/generate", json={"text": "x", "sampling_params": {**GREEDY, "max_new_tokens": 16}}
        )
        text = free.json()["text"]
        stop = text[3:6]
        stopped = client.post(
            "/generate", json={"text": "x", "sampling_params": {**GREEDY, "max_new_tokens": 16, "stop": stop}}
        ).json()
        assert stopped["text"] == text[: text.index(stop)]
        assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        kept = client.post(
            "/generate",
            json={
                "text": "x",
                "sampling_params": {**GREEDY, "max_new_tokens": 16, "stop": stop, "no_stop_trim": True},
            },
        ).json()
        assert kept["text"] == text[: text.index(stop) + len(stop)]


def test_control_routes(server: LiveServer) -> None:
    with server.client() as client:
        info = client.get("/get_model_info").json()
        assert info["is_generation"] is True and info["context_length"] == 1024
        server_info = client.get("/get_server_info").json()
        assert server_info["max_total_tokens"] == 16384 and server_info["host"] == "127.0.0.1"
        assert server_info["api_key"] is None
        assert client.get("/health").status_code == 200
        assert client.get("/health_generate").status_code == 200
        assert client.post("/flush_cache").status_code == 200
        # sglang-router's names for the same two routes (it asks for these first).
        assert client.get("/model_info").json() == info
        assert client.get("/server_info").json()["max_total_tokens"] == 16384


def test_generate_takes_the_fields_sglang_router_adds(server: LiveServer) -> None:
    router_fields = {
        "model": "any-name", "log_metrics": True, "no_logs": False,
        "background": False, "return_bytes": False, "return_entropy": False,
    }  # fmt: skip
    body = {"input_ids": [5, 6, 7], "sampling_params": {**GREEDY, "max_new_tokens": 3}}
    with server.client() as client:
        plain = client.post("/generate", json=body)
        forwarded = client.post("/generate", json={**body, **router_fields})
        assert forwarded.status_code == 200, forwarded.text
        assert forwarded.json()["output_ids"] == plain.json()["output_ids"]
        refused = client.post("/generate", json={**body, "return_entropy": True})
        assert refused.status_code == 422  # as every other invalid field here
        assert "return_entropy is not supported" in refused.json()["error"]["message"]


def test_abort_by_rid_and_abort_all_while_decoding(server: LiveServer) -> None:
    async def run() -> tuple[dict[str, Any], list[dict[str, Any]], int]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
            victim_chunks: list[dict[str, Any]] = []

            async def victim() -> dict[str, Any]:
                body = {"input_ids": [7, 8, 9], "sampling_params": LONG, "stream": True, "rid": "victim"}
                async with client.stream("POST", "/generate", json=body) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            victim_chunks.append(json.loads(line[6:]))
                            if len(victim_chunks) == 2:
                                await client.post("/abort_request", json={"rid": "victim"})
                return victim_chunks[-1]

            victim_result = await victim()

            bodies = [{"input_ids": [5, 6, 7 + i], "sampling_params": LONG} for i in range(16)]
            tasks = [asyncio.create_task(client.post("/generate", json=b)) for b in bodies]
            for _ in range(600):
                info = (await client.get("/get_server_info")).json()
                if info["num_running_reqs"] == 16:
                    break
                await asyncio.sleep(0.02)
            # While they decode: the health probe answers at once, and the cache cannot be flushed.
            health = await client.get("/health_generate", timeout=5)
            flush = await client.post("/flush_cache")
            assert health.status_code == 200 and flush.status_code == 400
            assert "requests are running" in flush.json()["error"]["message"]
            await client.post("/abort_request", json={"abort_all": True})
            results = [(await t).json() for t in tasks]
            return victim_result, results, info["num_running_reqs"]

    victim, results, running = asyncio.run(run())
    assert victim["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(victim["output_ids"]) < LONG["max_new_tokens"]
    assert running == 16
    assert [r["meta_info"]["finish_reason"]["type"] for r in results] == ["abort"] * 16
    assert all(len(r["output_ids"]) < LONG["max_new_tokens"] for r in results)
    server.assert_idle_and_kv_intact()


def test_generate_from_input_embeds_with_hidden_states(server: LiveServer, tiny_model_dir: Any) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"))
    prompt = [5, 6, 7, 8]
    vectors = model.model.embed_tokens.weight[prompt].tolist()
    params = {"temperature": 0.0, "max_new_tokens": 5, "ignore_eos": True}
    with server.client() as client:
        by_ids = client.post("/generate", json={"input_ids": prompt, "sampling_params": params}).json()
        body = {"input_embeds": vectors, "sampling_params": params, "return_hidden_states": True}
        by_vectors = client.post("/generate", json=body).json()
        assert by_vectors["output_ids"] == by_ids["output_ids"]
        prompt_part, *output_part = by_vectors["meta_info"]["hidden_states"]
        assert len(prompt_part) == 4 and len(output_part) == 4
        assert all(len(h) == 64 for h in prompt_part + output_part)
        bad = client.post("/generate", json={"input_embeds": [[0.0] * 3], "sampling_params": params})
        assert bad.status_code == 400 and "vectors of 64 numbers" in bad.json()["error"]["message"]
