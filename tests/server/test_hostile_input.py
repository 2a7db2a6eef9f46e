"""Values that parse as JSON but nothing behind the HTTP layer can hold are a 400 naming the field,
on every route, and the same keep-alive connection goes on serving."""

from __future__ import annotations

from typing import Any

import pytest

from tests.server.conftest import LiveServer

# Only requests, no state changes: the session's shared server (tests/server/conftest.py).
SHARED_SERVER = True

CHAT = "/v1/chat/completions"
# Raw bodies: json.dumps cannot write a lone surrogate that Python's json.loads reads back as one.
HOSTILE = [
    ("/generate", b'{"text": "hi \\ud800", "sampling_params": {"max_new_tokens": 2}}', "text"),
    (CHAT, b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}', "messages[0].content"),
    ("/v1/completions", b'{"prompt": [5, 6, 100000000000000000000], "max_tokens": 2}', "prompt[2]"),
    ("/generate", b'{"input_ids": [5], "sampling_params": {"top_p": 1e400}}', "sampling_params.top_p"),
    ("/v1/completions", b'{"prompt": "a", "temperature": NaN}', "temperature"),
    ("/v1/completions", b'{"prompt": "a", "max_tokens": -100000000000000000000}', "max_tokens"),
    ("/generate", b'{"input_ids": [5], "rid": "\\ud800"}', "rid"),
    ("/v1/completions", b'{"prompt": "a", "logit_bias": {"\\ud83d": 1}}', "logit_bias.\\ud83d"),
]  # fmt: skip


@pytest.mark.parametrize(("route", "body", "param"), HOSTILE)
def test_unholdable_values_are_a_400_naming_the_field(
    server: LiveServer, route: str, body: bytes, param: str
) -> None:
    with server.client() as client:
        response = client.post(route, content=body, headers={"content-type": "application/json"})
        assert response.status_code == 400, response.text
        error: dict[str, Any] = response.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error"
        assert "Traceback" not in response.text
        # The same connection goes on serving.
        ok = client.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}})
        assert ok.status_code == 200, ok.text


def test_nesting_too_deep_for_the_parser_is_a_400(server: LiveServer) -> None:
    body = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with server.client() as client:
        response = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert response.status_code == 400, response.text
        assert "nested too deeply" in response.json()["error"]["message"]


def test_n_choices_with_a_seed_differ_and_reproduce(server: LiveServer) -> None:
    body = {"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 1.0, "n": 4, "seed": 11}
    with server.client() as client:
        first = client.post("/v1/completions", json=body).json()["choices"]
        again = client.post("/v1/completions", json=body).json()["choices"]
        single = client.post("/v1/completions", json={**body, "n": 1}).json()["choices"]
    texts = [c["text"] for c in first]
    assert len(set(texts)) > 1, texts  # 4 samples of 8 tokens at temperature 1: not all the same
    assert texts == [c["text"] for c in again]
    assert texts[0] == single[0]["text"]  # choice 0 keeps the seed itself
