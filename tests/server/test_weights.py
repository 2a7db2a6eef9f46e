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
        assert missing.status_code == 400 and "no place" in missing.json()["error"]["message"]


def release_while_busy(base_url: str) -> tuple[int, str]:
    async def run() -> tuple[int, str]:
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
            long = {"input_ids": [9, 9], "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}
            task = asyncio.create_task(client.post("/generate", json=long))
            while (await client.get("/get_server_info")).json()["num_running_reqs"] == 0:
                await asyncio.sleep(0.01)
            refused = await client.post("/release_memory_occupation")
            await client.post("/abort_request", json={"abort_all": True})
            await task
            return refused.status_code, refused.json()["error"]["message"]

    return asyncio.run(run())


def test_release_and_resume_memory_over_http(
    tiny_model_dir: Callable[[str], Path], start_server: Any, tmp_path: Path
) -> None:
    live = start_server(tiny_model_dir("llama"), "--dtype", "bfloat16")
    body = {"input_ids": [5, 6, 7], "sampling_params": {"temperature": 0.0, "max_new_tokens": 6}}
    with live.client() as client:
        before = client.post("/generate", json=body).json()["output_ids"]
        released = client.post("/release_memory_occupation")
        assert released.status_code == 200 and released.json() == {"released": ["kv_cache", "weights"]}
        # On a CPU the weights wait in a temporary file under the server's TMPDIR.
        assert any(p.name.startswith("radixserve-weights-") for p in live.tmp_dir.iterdir())
        refused = client.post("/generate", json=body)
        assert refused.status_code == 503 and "resume_memory_occupation" in refused.text
        assert client.post("/resume_memory_occupation", json={"tags": ["weights", "kv_cache"]}).is_success
        assert client.post("/generate", json=body).json()["output_ids"] == before
        status, message = release_while_busy(live.base_url)
        assert status == 400 and "while requests are running" in message
        assert client.post("/generate", json=body).json()["output_ids"] == before
        bad = client.post("/release_memory_occupation", json={"tags": ["everything"]})
        assert bad.status_code == 400 and "tags must be" in bad.json()["error"]["message"]
        # Left released: stopping the server must still remove the spilled weights (finish checks).
        assert client.post("/release_memory_occupation", json={"tags": ["weights"]}).is_success
