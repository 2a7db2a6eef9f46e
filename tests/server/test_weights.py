"""Weight updates from disk and reading weights by name, through the HTTP server."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import torch

from tests.conftest import build_tiny_model
from tests.engine.oracle import GreedyOracle


def in_flight_is_aborted(base_url: str, model_path: str) -> bool:
    """Updates the weights (back to model_path) while a long request decodes; it must end in abort."""

    async def run() -> bool:
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
            long = {"input_ids": [9, 9], "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}
            task = asyncio.create_task(client.post("/generate", json=long))
            while (await client.get("/get_server_info")).json()["num_running_reqs"] == 0:
                await asyncio.sleep(0.01)
            assert (
                await client.post("/update_weights_from_disk", json={"model_path": model_path})
            ).is_success
            return bool((await task).json()["meta_info"]["finish_reason"]["type"] == "abort")

    return asyncio.run(run())


def test_update_weights_from_disk_switches_models_and_survives_a_bad_path(
    tiny_model_dir: Callable[[str], Path], tiny_tokenizer: Any, start_server: Any, tmp_path: Path
) -> None:
    other = build_tiny_model("llama", tiny_tokenizer, tmp_path / "other", seed=1)
    prompt = [5, 6, 7, 8]
    live = start_server(tiny_model_dir("llama"))
    body = {
        "input_ids": prompt,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True},
    }
    with live.client() as client:
        before = client.post("/generate", json=body).json()["output_ids"]
        updated = client.post("/update_weights_from_disk", json={"model_path": str(other)})
        assert updated.status_code == 200 and updated.json()["model_path"] == str(other)
        assert in_flight_is_aborted(live.base_url, str(other))
        after = client.post("/generate", json=body).json()["output_ids"]
        assert after == GreedyOracle(other).continue_(prompt, 8) != before

        bad = client.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "missing")})
        assert bad.status_code == 400 and "missing" in bad.json()["error"]["message"]
        assert client.post("/generate", json=body).json()["output_ids"] == after

        values = client.post(
            "/get_weights_by_name", json={"name": "model.norm.weight", "truncate_size": 5}
        ).json()
        reference = GreedyOracle(other).model.model.norm.weight[:5]
        torch.testing.assert_close(torch.tensor(values["values"]), reference.detach())
        missing = client.post("/get_weights_by_name", json={"name": "nope"})
        assert missing.status_code == 400 and "no parameter" in missing.json()["error"]["message"]
