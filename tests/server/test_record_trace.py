"""--record-trace on a live server: each finished request becomes a line of simulate's trace
format (arrival, the prompt's token ids as scheduled, the tokens generated), and the simulator
replays the file: same requests, same lengths, the shared prefix shared again."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from radixserve.models.config import ModelConfig
from radixserve_tools.simulator.hardware import BUILTIN_PROFILES
from radixserve_tools.simulator.simulate import simulate
from radixserve_tools.simulator.trace import load_trace
from tests.engine.oracle import random_prompts
from tests.server.conftest import LiveServer

PARAMS = {"temperature": 0.0, "max_new_tokens": 5, "ignore_eos": True}
LONG = {"temperature": 0.0, "max_new_tokens": 900, "ignore_eos": True}


def _rows(path: Path, count: int) -> list[dict[str, Any]]:
    """The trace's lines once there are `count`: a writer thread appends them just after the
    requests finish."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) >= count:
            break
        time.sleep(0.05)
    return [json.loads(line) for line in lines]


def _aborted_stream(server: LiveServer, client: Any) -> dict[str, Any]:
    """A streamed request aborted by rid after two chunks; its last chunk."""
    body = {"input_ids": [7, 8, 9], "sampling_params": LONG, "stream": True, "rid": "trace-victim"}
    chunks: list[dict[str, Any]] = []
    with client.stream("POST", "/generate", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
                if len(chunks) == 2:
                    with server.client() as other:
                        other.post("/abort_request", json={"rid": "trace-victim"}).raise_for_status()
    return chunks[-1]


def test_a_recorded_trace_replays_in_the_simulator(
    start_server: Callable[..., LiveServer], tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    trace_path = tmp_path / "traces" / "served.jsonl"
    model = tiny_model_dir("llama")
    tokenizer = AutoTokenizer.from_pretrained(model)
    server = start_server(model, "--record-trace", str(trace_path))
    shared = random_prompts(1, [48], seed=90)[0]
    prompts = [shared + tail for tail in random_prompts(2, [6, 9], seed=91)]
    text = "the quick brown fox"
    messages = [{"role": "user", "content": "hi"}]
    with server.client() as client:
        completions = [
            client.post("/generate", json={"input_ids": prompt, "sampling_params": PARAMS}).json()
            for prompt in prompts
        ]
        plain = client.post("/v1/completions", json={"model": model.name, "prompt": text, "max_tokens": 4})
        chat = client.post(
            "/v1/chat/completions", json={"model": model.name, "messages": messages, "max_tokens": 3}
        )
        # A prompt of vectors has no ids: its line gives the prompt's length instead.
        vectors = client.post(
            "/generate", json={"input_embeds": [[0.01] * 64] * 4, "sampling_params": PARAMS}
        )
        aborted = _aborted_stream(server, client)
        # Refused before it ran (an unknown sampling field): not traffic the server served.
        refused = client.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"nope": 1}})
    for response in (plain, chat, vectors):
        response.raise_for_status()
    assert refused.status_code == 400
    server.assert_idle_and_kv_intact()

    rows = _rows(trace_path, 6)
    assert [r["arrival_s"] for r in rows] == sorted(r["arrival_s"] for r in rows)
    assert [r["input_len"] for r in rows] == [len(r["input_ids"]) for r in rows[:4]] + [4, 3]
    # The ids as scheduled: the given ones, the tokenized text, the chat through its template.
    template = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert [r["input_ids"] for r in rows[:4]] == [
        *prompts,
        tokenizer.encode(text),
        tokenizer.encode(template, add_special_tokens=False),
    ]
    assert "input_ids" not in rows[4] and rows[0]["arrival_s"] >= 0
    # One request at a time: each reached an idle scheduler, which recorded when it took it.
    assert all(r["arrival_s"] <= r["received_s"] < r["arrival_s"] + 30 for r in rows[:5])
    # Every request that produced output says when the scheduler took it: idle or busy, not both.
    assert all(("received_s" in r) != ("received_busy_s" in r) for r in rows)
    # And when it sent the first output: after it took the request, before the engine saw it.
    assert all(r.get("received_s", r.get("received_busy_s")) <= r["first_output_s"] for r in rows)
    usages = [c["meta_info"] for c in completions] + [plain.json()["usage"], chat.json()["usage"]]
    usages += [vectors.json()["meta_info"], aborted["meta_info"]]
    assert [r["output_len"] for r in rows] == [u["completion_tokens"] for u in usages]
    assert [r["finish"] for r in rows[:2]] == ["length", "length"] and rows[5]["finish"] == "abort"
    assert 2 <= rows[5]["output_len"] < LONG["max_new_tokens"]  # what it generated before the abort

    config = ModelConfig.from_hf_dict(json.loads((model / "config.json").read_text()))
    trace = load_trace(trace_path)
    assert [len(r.input_ids) for r in trace] == [r["input_len"] for r in rows]
    result = simulate(config, BUILTIN_PROFILES["H100"], trace, 4096)
    assert result.requests == len(rows)
    assert result.output_tokens == sum(r["output_len"] for r in rows)
    assert result.input_tokens == sum(r["input_len"] for r in rows)
    assert result.cache_hit_rate > 0  # the second prompt's 48-token prefix, shared again
