"""--dp-size 2: requests spread over two scheduler replicas with the same outputs as one, control
commands (stats, flush, KV check) reach both, and so does abort-all."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from radixserve.protocol.messages import ControlResult, TextOutput
from radixserve.runtime.engine import Engine
from tests.engine.oracle import GREEDY, final_output, random_prompts


def test_two_replicas_serve_64_requests_like_one(
    tiny_model_dir: Callable[[str], Path], make_engine: Callable[..., Engine]
) -> None:
    path = tiny_model_dir("llama")
    prompts = random_prompts(64, seed=11)
    params = {**GREEDY, "max_new_tokens": 6}
    single = make_engine(path).generate(input_ids=prompts, sampling_params=params)
    for method in ("round_robin", "shortest_queue"):
        engine = make_engine(path, dp_size=2, load_balance_method=method)
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        assert isinstance(outs, list) and isinstance(single, list)
        assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in single]
        stats = engine.get_stats()
        per_replica = [r["generated_tokens"] for r in stats["dp_replicas"]]
        assert all(n > 0 for n in per_replica) and sum(per_replica) == stats["generated_tokens"] == 64 * 6
        assert stats["kv_invariant"] == "ok" and stats["idle"] is True
        assert engine.flush_cache()


def test_abort_all_reaches_every_replica(
    tiny_model_dir: Callable[[str], Path], make_engine: Callable[..., Engine]
) -> None:
    engine = make_engine(tiny_model_dir("llama"), dp_size=2)
    boxes: list[queue.Queue[Any]] = []
    for prompt in random_prompts(8, seed=12):
        box: queue.Queue[TextOutput | ControlResult] = queue.Queue()
        engine.submit(engine.requests.build(prompt, {"max_new_tokens": 2000, "ignore_eos": True}), box.put)
        boxes.append(box)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        running = [r["num_running_reqs"] for r in engine.get_stats()["dp_replicas"]]
        if all(n > 0 for n in running):
            break
        time.sleep(0.05)
    assert all(n > 0 for n in running), running
    engine.abort(abort_all=True)
    for box in boxes:
        assert final_output(box).finished_reason.type == "abort"
