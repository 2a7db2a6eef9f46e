"""The OpenAI-compatible API through the official `openai` client, against a live tiny-llama server."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.server.conftest import LiveServer

# Only requests, no state changes: the session's shared server (tests/server/conftest.py).
SHARED_SERVER = True

GREEDY: dict[str, Any] = {"temperature": 0.0}


def model_id(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_models_lists_the_served_model(server: LiveServer) -> None:
    models = server.openai().models.list().data
    assert len(models) == 1 and models[0].object == "model"


def test_completion_non_stream_and_stream_agree(server: LiveServer) -> None:
    client = server.openai()
    model = model_id(client)
    full = client.completions.create(model=model, prompt="def main():", max_tokens=12, **GREEDY)
    choice = full.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert full.usage is not None and full.usage.completion_tokens == 12
    assert full.usage.prompt_tokens > 0 and full.usage.total_tokens == full.usage.prompt_tokens + 12

    chunks = list(
        client.completions.create(
            model=model,
            prompt="def main():",
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0].choices == []
    assert usage_chunks[0].usage.completion_tokens == 12  # type: ignore[union-attr]


def test_cached_tokens_are_reported(server: LiveServer) -> None:
    client = server.openai()
    prompt = "import os\nimport sys\n" * 8
    client.completions.create(model=model_id(client), prompt=prompt, max_tokens=2, **GREEDY)
    again = client.completions.create(model=model_id(client), prompt=prompt, max_tokens=2, **GREEDY)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens >= again.usage.prompt_tokens - 1


def test_n_list_prompts_and_token_prompts(server: LiveServer) -> None:
    client = server.openai()
    model = model_id(client)
    two = client.completions.create(model=model, prompt="hello", n=2, max_tokens=6, temperature=1.0, seed=3)
    assert [c.index for c in two.choices] == [0, 1]
    assert all(c.finish_reason == "length" for c in two.choices)

    listed = client.completions.create(model=model, prompt=["a = 1", "for i in"], max_tokens=5, **GREEDY)
    alone = [
        client.completions.create(model=model, prompt=p, max_tokens=5, **GREEDY).choices[0].text
        for p in ["a = 1", "for i in"]
    ]
    assert [c.text for c in listed.choices] == alone

    ids = client.completions.create(model=model, prompt=[5, 6, 7, 8], max_tokens=4, **GREEDY)
    batch_ids = client.completions.create(model=model, prompt=[[5, 6, 7, 8], [9, 10]], max_tokens=4, **GREEDY)
    assert ids.choices[0].text == batch_ids.choices[0].text
    assert ids.usage is not None and ids.usage.prompt_tokens == 4
    assert batch_ids.usage is not None and batch_ids.usage.prompt_tokens == 6


def test_echo_prepends_the_prompt(server: LiveServer) -> None:
    client = server.openai()
    out = client.completions.create(model=model_id(client), prompt="x = 1", max_tokens=3, echo=True, **GREEDY)
    assert out.choices[0].text.startswith("x = 1")


def test_chat_non_stream_and_stream(server: LiveServer) -> None:
    client = server.openai()
    model = model_id(client)
    messages: Any = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    full = client.chat.completions.create(model=model, messages=messages, max_tokens=10, **GREEDY)
    assert full.choices[0].message.role == "assistant"
    assert full.usage is not None and 1 <= full.usage.completion_tokens <= 10

    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=10,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert mine[0].delta.role == "assistant"
        assert [c.finish_reason for c in mine if c.finish_reason] == [full.choices[0].finish_reason]
        assert "".join(c.delta.content or "" for c in mine) == full.choices[0].message.content
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0].completion_tokens == 2 * full.usage.completion_tokens


def test_stop_strings_are_trimmed_even_when_split_across_tokens(server: LiveServer) -> None:
    client = server.openai()
    model = model_id(client)
    tokenizer_text = client.completions.create(model=model, prompt="def main():", max_tokens=24, **GREEDY)
    text = tokenizer_text.choices[0].text
    # A stop string that starts inside one token and ends inside a later one: the tail of the
    # 6th character onward, 3 characters long, picked from the real greedy output.
    assert len(text) > 12
    stop = text[5:8]
    expected = text[: text.index(stop)]

    out = client.completions.create(model=model, prompt="def main():", max_tokens=24, stop=[stop], **GREEDY)
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"

    streamed = client.completions.create(
        model=model, prompt="def main():", max_tokens=24, stop=stop, stream=True, **GREEDY
    )
    pieces = [c.choices[0].text for c in streamed if c.choices]
    # Text once sent cannot be taken back: no partial stop string may ever have been emitted.
    assert "".join(pieces) == expected


def test_api_key_is_required_when_set(tiny_model_dir: Callable[[str], Path], start_server: Any) -> None:
    live = start_server(tiny_model_dir("llama"), api_key="sekret")
    good = live.openai()
    assert good.completions.create(model=model_id(good), prompt="hi", max_tokens=2).choices
    bad = openai.OpenAI(base_url=f"{live.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with live.client() as http:
        assert http.get("/health", headers={"Authorization": ""}).status_code == 200
        missing = http.post("/generate", json={"text": "hi"}, headers={"Authorization": ""})
        assert missing.status_code == 401 and "API key" in missing.json()["error"]["message"]


def test_n_samples_prefill_the_prompt_once(server: LiveServer) -> None:
    client = server.openai()
    prompt = [300 + i for i in range(40)]  # not used by any other test, so nothing of it is cached
    out = client.completions.create(
        model=model_id(client), prompt=prompt, n=4, max_tokens=3, temperature=1.0, seed=5
    )
    assert len(out.choices) == 4 and out.usage is not None and out.usage.prompt_tokens == 40
    # The first sample computes the prompt; the other three reuse all of it but the last token.
    assert out.usage.prompt_tokens_details is not None
    assert out.usage.prompt_tokens_details.cached_tokens == 3 * 39
