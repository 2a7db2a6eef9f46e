"""`priority` through a live server with --enable-priority-scheduling and a KV pool too small for
every request at once: outputs equal to each request served alone, whatever preemption happened,
and the KV intact after. (Which request runs when is the scheduler's, tested on a fake executor in
tests/scheduler/test_scheduler_priority.py.)"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tests.server.conftest import LiveServer

LONG = {"temperature": 0.0, "max_new_tokens": 120, "ignore_eos": True}


def test_priorities_keep_outputs_exact_in_a_small_pool(
    tiny_model_dir: Callable[[str], Path], start_server: Callable[..., LiveServer]
) -> None:
    server = start_server(
        tiny_model_dir("llama"), "--enable-priority-scheduling", "--max-total-tokens", "320"
    )
    prompts = [[10 + i, 20 + i, 30 + i, 40 + i] * 8 for i in range(3)]
    with server.client() as client:
        alone = [
            client.post("/generate", json={"input_ids": p, "sampling_params": LONG}).json()["output_ids"]
            for p in prompts
        ]

        def generate(index: int) -> list[int]:
            body: dict[str, Any] = {"input_ids": prompts[index], "sampling_params": LONG}
            body["priority"] = 100 if index == 2 else 0
            answer = client.post("/generate", json=body)
            assert answer.status_code == 200, answer.text
            ids: list[int] = answer.json()["output_ids"]
            return ids

        with ThreadPoolExecutor(3) as pool:
            together = list(pool.map(generate, range(3)))
        assert together == alone
        # The batch form takes one priority per prompt, and the OpenAI routes take the field too.
        batch = client.post(
            "/generate", json={"input_ids": prompts[:2], "sampling_params": LONG, "priority": [1, 50]}
        ).json()
        assert [b["output_ids"] for b in batch] == alone[:2]
        completion = client.post(
            "/v1/completions",
            json={"prompt": prompts[0], "max_tokens": 4, "temperature": 0, "priority": 7},
        ).json()
        assert completion["choices"][0]["finish_reason"] == "length"
        wrong = client.post("/generate", json={"input_ids": prompts[:2], "priority": [1]})
        assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "priority"
    server.assert_idle_and_kv_intact()
