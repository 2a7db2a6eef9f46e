"""LoRA adapters behind a live server: /generate's lora_path, OpenAI's model naming an adapter
(listed in /v1/models), /load_lora_adapter and /unload_lora_adapter, and their refusals. Outputs
equal transformers + peft (fp32 greedy)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx

from tests.engine.oracle import GreedyOracle, random_prompts
from tests.server.conftest import LiveServer

MAX_NEW = 8
PARAMS = {"temperature": 0.0, "max_new_tokens": MAX_NEW, "ignore_eos": True}


def generate(client: httpx.Client, body: dict[str, object]) -> httpx.Response:
    return client.post("/generate", json={"sampling_params": PARAMS, **body})


def test_adapters_over_http(
    start_server: Callable[..., LiveServer],
    tiny_model_dir: Callable[[str], Path],
    lora_adapters: dict[str, Path],
) -> None:
    model = tiny_model_dir("llama")
    server = start_server(model, "--lora-paths", f"a={lora_adapters['a']}", "--max-lora-rank", "8",
                          "--lora-target-modules", "all")  # fmt: skip
    prompts = random_prompts(2, [12, 20], seed=60)
    with server.client() as client:
        # /generate: one adapter per prompt, and the base model.
        response = generate(client, {"input_ids": prompts, "lora_path": ["a", None]})
        response.raise_for_status()
        results = response.json()
        assert results[0]["output_ids"] == GreedyOracle(model, lora_adapters["a"]).continue_(
            prompts[0], MAX_NEW
        )
        assert results[1]["output_ids"] == GreedyOracle(model).continue_(prompts[1], MAX_NEW)
        # An adapter not loaded: a 400 naming it; the server keeps serving.
        refused = generate(client, {"input_ids": prompts[0], "lora_path": "b"})
        assert refused.status_code == 400 and "'b' is not loaded" in refused.json()["error"]["message"]
        # Loaded at run time, then listed and served under OpenAI's model name.
        loaded = client.post(
            "/load_lora_adapter", json={"lora_name": "b", "lora_path": str(lora_adapters["b"])}
        )
        loaded.raise_for_status()
        assert loaded.json() == {
            "success": True,
            "loaded_adapters": {"a": str(lora_adapters["a"]), "b": str(lora_adapters["b"])},
        }
        models = client.get("/v1/models").json()["data"]
        assert [m["id"] for m in models[1:]] == ["a", "b"] and models[2]["parent"] == models[0]["id"]
        completion = client.post(
            "/v1/completions",
            json={"model": "b", "prompt": prompts[1], "max_tokens": MAX_NEW, "temperature": 0},
        )
        completion.raise_for_status()
        native = generate(client, {"input_ids": prompts[1], "lora_path": "b"}).json()
        assert native["output_ids"] == GreedyOracle(model, lora_adapters["b"]).continue_(prompts[1], MAX_NEW)
        assert completion.json()["choices"][0]["text"] == native["text"]
        unknown = client.post("/v1/completions", json={"model": "c", "prompt": "hi", "max_tokens": 2})
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
        # A bad adapter loads nothing (rank 8 > 8 is fine; another base model's is not).
        bad = client.post("/load_lora_adapter", json={"lora_name": "x", "lora_path": str(model)})
        assert bad.status_code == 400
        unloaded = client.post("/unload_lora_adapter", json={"lora_name": "b"})
        assert unloaded.json()["loaded_adapters"] == {"a": str(lora_adapters["a"])}
        again = client.post("/unload_lora_adapter", json={"lora_name": "b"})
        assert again.status_code == 400 and "not loaded" in again.json()["error"]["message"]
