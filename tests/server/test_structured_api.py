"""Structured output through the OpenAI client and the native API."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import openai
import pytest

from tests.engine.test_structured_output import SCHEMA
from tests.server.conftest import LiveServer

# Only requests, no state changes: the session's shared server (tests/server/conftest.py).
SHARED_SERVER = True


def test_response_format_json_schema_stream_and_not(server: LiveServer) -> None:
    client = server.openai()
    model = client.models.list().data[0].id
    messages: Any = [{"role": "user", "content": "Describe a pet."}]
    response_format: Any = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}
    for seed in range(3):
        chat = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=256,
            temperature=1.0,
            seed=seed,
            response_format=response_format,
        )
        jsonschema.validate(json.loads(chat.choices[0].message.content or ""), SCHEMA)
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=256,
        temperature=1.0,
        seed=7,
        response_format=response_format,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)

    regex = client.completions.create(
        model=model, prompt="id:", max_tokens=32, temperature=1.0, extra_body={"regex": "[0-9]{4}"}
    )
    assert re.fullmatch("[0-9]{4}", regex.choices[0].text)


def test_invalid_grammars_are_a_400(server: LiveServer) -> None:
    client = server.openai()
    model = client.models.list().data[0].id
    bad: Any = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}
    with pytest.raises(openai.BadRequestError, match="invalid json_schema"):
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "x"}], max_tokens=8, response_format=bad
        )
    with server.client() as http:
        native = http.post("/generate", json={"text": "x", "sampling_params": {"regex": "(unclosed"}})
        assert native.status_code == 400 and "invalid regex" in native.json()["error"]["message"]
        both = http.post(
            "/generate", json={"text": "x", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}}
        )
        assert both.status_code == 400 and "at most one" in both.json()["error"]["message"]
        streamed = http.post(
            "/v1/completions", json={"prompt": "x", "max_tokens": 4, "stream": True, "regex": "(unclosed"}
        )
        assert '"invalid regex' in streamed.text and streamed.text.rstrip().endswith("[DONE]")
