"""--record-trace on a live server: each finished request becomes a line of simulate's trace
format (arrival, the prompt's token ids as scheduled, the tokens generated), and the simulator
replays the file: same requests, same lengths, the shared prefix shared again."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from radixserve.models.config import ModelConfig
from radixserve.simulator.hardware import BUILTIN_PROFILES
from radixserve.simulator.simulate import simulate
from radixserve.simulator.trace import load_trace
from tests.engine.oracle import random_prompts
from tests.server.conftest import LiveServer

PARAMS = {"temperature": 0.0, "max_new_tokens": 5, "ignore_eos": True}


def test_a_recorded_trace_replays_in_the_simulator(
    start_server: Callable[..., LiveServer], tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    trace_path = tmp_path / "traces" / "served.jsonl"
    model = tiny_model_dir("llama")
    server = start_server(model, "--record-trace", str(trace_path))
    shared = random_prompts(1, [48], seed=90)[0]
    prompts = [shared + tail for tail in random_prompts(2, [6, 9], seed=91)]
    with server.client() as client:
        for prompt in prompts:
            client.post("/generate", json={"input_ids": prompt, "sampling_params": PARAMS}).raise_for_status()
        chat = client.post(
            "/v1/chat/completions",
            json={"model": model.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        )
        chat.raise_for_status()
        usage = chat.json()["usage"]
        # Refused before it ran (an unknown sampling field): not traffic the server served.
        assert (
            client.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"nope": 1}}).status_code
            == 400
        )
    rows = [json.loads(line) for line in trace_path.read_text().splitlines()]
    assert len(rows) == 3
    assert [r["input_ids"] for r in rows[:2]] == prompts
    assert [r["output_len"] for r in rows[:2]] == [5, 5]
    assert len(rows[2]["input_ids"]) == usage["prompt_tokens"]
    assert rows[2]["output_len"] == usage["completion_tokens"]
    assert [r["arrival_s"] for r in rows] == sorted(r["arrival_s"] for r in rows)
    assert all(r["finish"] in ("length", "stop") for r in rows)

    config = ModelConfig.from_hf_dict(json.loads((model / "config.json").read_text()))
    trace = load_trace(trace_path)
    result = simulate(config, BUILTIN_PROFILES["H100"], trace, 4096)
    assert result.requests == 3
    assert result.output_tokens == sum(r["output_len"] for r in rows)
    assert result.input_tokens == sum(len(r["input_ids"]) for r in rows)
    assert result.cache_hit_rate > 0  # the second prompt's 48-token prefix, shared again
