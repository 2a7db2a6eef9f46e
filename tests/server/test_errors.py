"""Bad input gets a clear OpenAI-style error with the right status, and the server keeps serving."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.conftest import LiveServer, finish, launch


@pytest.fixture(scope="module")
def small_body_server(
    tiny_model_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    live = launch(tiny_model_dir("llama"), tmp_path_factory.mktemp("errors"), "--max-request-body-mb", "0.05")
    yield live
    finish(live)


COMPLETION = {"model": None, "prompt": "hi", "max_tokens": 4}

BAD_REQUESTS: list[tuple[str, dict[str, Any], int, str]] = [
    ("/v1/completions", {"max_tokens": -1}, 400, "max_new_tokens must be a non-negative integer"),
    ("/v1/completions", {"temperature": -0.5}, 400, "temperature must be >= 0"),
    ("/v1/completions", {"top_p": 0.0}, 400, "top_p must be in (0, 1]"),
    ("/v1/completions", {"top_p": 1.5}, 400, "top_p must be in (0, 1]"),
    ("/v1/completions", {"n": 0}, 400, "n must be >= 1"),
    ("/v1/completions", {"prompt": ["a"] * 9, "n": 128}, 400, "9 prompts x n=128 make 1152 choices"),
    ("/v1/completions", {"prompt": [5] * 2000}, 400, "2000 tokens, but the model's context length is 1024"),
    ("/v1/completions", {"prompt": []}, 400, "prompt must not be empty"),
    ("/v1/completions", {"model": "gpt-17"}, 404, "The model 'gpt-17' does not exist"),
    ("/v1/completions", {"max_tokens": "many"}, 422, "max_tokens"),
    ("/v1/completions", {"logprobs": 21}, 400, "top_logprobs_num must be in [0, 20]"),
    ("/v1/completions", {"frequency_penalty": 2.5}, 400, "frequency_penalty must be in [-2, 2]"),
    ("/v1/completions", {"logit_bias": {"99999": 5}}, 400, "outside the vocabulary"),
    ("/v1/completions", {"stop": [""]}, 400, "stop must be"),
    ("/v1/chat/completions", {"messages": []}, 422, "messages"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
        400,
        "unknown response_format type",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "this model takes no images",
    ),
    (
        "/generate",
        {"text": "hi", "sampling_params": {"bogus": 1}},
        400,
        "unsupported sampling parameter(s): bogus",
    ),
    ("/generate", {"text": "hi", "input_ids": [1]}, 400, "exactly one of text, input_ids or input_embeds"),
    ("/generate", {"input_ids": [5, 10**7]}, 400, "prompt token ids must be integers in"),
    (
        "/generate",
        {"text": "hi", "return_logprob": True, "logprob_start_len": 99},
        400,
        "logprob_start_len must be",
    ),
    ("/nope", {}, 404, "Not Found"),
    ("/v1/embeddings", {"input": "hi"}, 400, "does not serve embeddings"),
]


@pytest.mark.parametrize(("path", "fields", "status", "message"), BAD_REQUESTS)
def test_bad_input_gets_a_clear_error(
    small_body_server: LiveServer, path: str, fields: dict[str, Any], status: int, message: str
) -> None:
    body = {**COMPLETION, **fields} if path == "/v1/completions" else fields
    if path == "/v1/chat/completions":
        body = {"max_tokens": 4, **fields}
    with small_body_server.client() as client:
        response = client.post(path, json={k: v for k, v in body.items() if v is not None})
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert message in error["message"] and error["type"]
        # Still serving, and nothing leaked.
        ok = client.post("/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}})
        assert ok.status_code == 200


# The field an error names, as the client spelled it: OpenAI's names on its routes, the native ones
# (under sampling_params) on /generate; SamplingParams' single check names the native field.
NAMED_FIELDS: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/completions", {**COMPLETION, "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {**COMPLETION, "stop": ["s"] * 17}, "stop"),
    ("/v1/completions", {**COMPLETION, "min_tokens": 9}, "min_tokens"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"99999": 5}}, "logit_bias"),
    ("/generate", {"text": "hi", "sampling_params": {"top_k": 1.5}}, "sampling_params.top_k"),
    ("/generate", {"text": ["a", "b"], "sampling_params": [{}, {"seed": "x"}]}, "sampling_params[1].seed"),
    ("/generate", {"text": "hi", "sampling_params": {"bogus": 1}}, "sampling_params.bogus"),
]


@pytest.mark.parametrize(("path", "body", "param"), NAMED_FIELDS)
def test_errors_name_the_field_as_the_client_sent_it(
    small_body_server: LiveServer, path: str, body: dict[str, Any], param: str
) -> None:
    with small_body_server.client() as client:
        response = client.post(path, json={k: v for k, v in body.items() if v is not None})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param, response.text


def test_invalid_json_and_oversized_bodies(small_body_server: LiveServer) -> None:
    with small_body_server.client() as client:
        broken = client.post(
            "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
        )
        assert broken.status_code == 422 and "error" in broken.json()
        huge = client.post("/v1/completions", json={"prompt": "x" * 100_000, "max_tokens": 1})
        assert huge.status_code == 413 and "larger than" in huge.json()["error"]["message"]
        # Without a Content-Length header the cap still holds while the body streams in.
        chunks = (b"x" * 10_000 for _ in range(10))
        streamed = client.post("/generate", content=chunks, headers={"content-type": "application/json"})
        assert streamed.status_code == 413
        assert client.get("/health").status_code == 200


def test_auto_truncate_and_queue_bound(tiny_model_dir: Callable[[str], Path], start_server: Any) -> None:
    live = start_server(tiny_model_dir("llama"), "--allow-auto-truncate", "--max-queued-requests", "1")
    with live.client() as client:
        cut = client.post(
            "/generate", json={"input_ids": [5] * 2000, "sampling_params": {"max_new_tokens": 1}}
        )
        assert cut.status_code == 200 and cut.json()["meta_info"]["prompt_tokens"] == 1023

    async def burst() -> list[int]:
        async with httpx.AsyncClient(base_url=live.base_url, timeout=60) as client:
            body = {"input_ids": [5] * 500, "sampling_params": {"max_new_tokens": 4}}
            responses = await asyncio.gather(*(client.post("/generate", json=body) for _ in range(8)))
            for r in responses:
                if r.status_code == 503:
                    assert "--max-queued-requests" in r.json()["error"]["message"]
                    # Clients (the official SDKs among them) back off for this long, then retry.
                    assert r.headers["retry-after"] == "1"
            return [r.status_code for r in responses]

    codes = asyncio.run(burst())
    assert set(codes) == {200, 503}, codes


ORIGIN = "https://app.example.com"
PREFLIGHT = {
    "Origin": ORIGIN,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}


def test_no_cors_headers_without_allow_origins(small_body_server: LiveServer) -> None:
    with small_body_server.client() as client:
        preflight = client.options("/v1/completions", headers=PREFLIGHT)
        assert "access-control-allow-origin" not in preflight.headers
        assert preflight.status_code in (404, 405), preflight.text  # no such route, as before
        get = client.get("/v1/models", headers={"Origin": ORIGIN})
        assert get.status_code == 200 and "access-control-allow-origin" not in get.headers


def test_allow_origins_answers_cors(tiny_model_dir: Callable[[str], Path], start_server: Any) -> None:
    live = start_server(tiny_model_dir("llama"), "--allow-origins", ORIGIN, api_key="sekret")
    # The preflight carries no key: the browser sends it before the real request.
    with httpx.Client(base_url=live.base_url, timeout=60) as anonymous:
        preflight = anonymous.options("/v1/completions", headers=PREFLIGHT)
        assert preflight.status_code == 200, preflight.text
        assert preflight.headers["access-control-allow-origin"] == ORIGIN
        allowed_methods = preflight.headers["access-control-allow-methods"]
        assert {"GET", "POST", "OPTIONS"} <= {m.strip() for m in allowed_methods.split(",")}
        allowed = {h.strip().lower() for h in preflight.headers["access-control-allow-headers"].split(",")}
        assert {"authorization", "content-type"} <= allowed
        other = anonymous.options("/v1/completions", headers={**PREFLIGHT, "Origin": "https://evil.example"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    with live.client() as client:
        get = client.get("/v1/models", headers={"Origin": ORIGIN})
        assert get.status_code == 200 and get.headers["access-control-allow-origin"] == ORIGIN
        post = client.post(
            "/generate",
            json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}},
            headers={"Origin": ORIGIN},
        )
        assert post.status_code == 200 and post.headers["access-control-allow-origin"] == ORIGIN
        # Other origins get no CORS headers (the browser then blocks the answer).
        foreign = client.get("/v1/models", headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in foreign.headers
