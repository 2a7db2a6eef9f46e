"""Logprobs and penalties through the native and OpenAI APIs."""

from __future__ import annotations

import math
from typing import Any

from tests.server.conftest import LiveServer

# Only requests, no state changes: the session's shared server (tests/server/conftest.py).
SHARED_SERVER = True


def test_native_logprobs_with_text(server: LiveServer) -> None:
    body = {
        "input_ids": [5, 6, 7],
        "sampling_params": {"max_new_tokens": 4, "temperature": 0.0},
        "return_logprob": True,
        "top_logprobs_num": 2,
        "return_text_in_logprobs": True,
    }
    with server.client() as client:
        result = client.post("/generate", json=body).json()
        meta = result["meta_info"]
        assert [t for _, t, _ in meta["output_token_logprobs"]] == result["output_ids"]
        assert all(isinstance(text, str) for _, _, text in meta["output_token_logprobs"])
        # Greedy: the chosen token is the most likely one.
        for (value, token, _), top in zip(
            meta["output_token_logprobs"], meta["output_top_logprobs"], strict=True
        ):
            assert top[0][1] == token and math.isclose(top[0][0], value, abs_tol=1e-6) and len(top) == 2
        scored = client.post("/generate", json={**body, "logprob_start_len": 1}).json()["meta_info"]
        assert [t for _, t, _ in scored["input_token_logprobs"]] == [6, 7]
        assert all(isinstance(text, str) for _, _, text in scored["input_token_logprobs"])
        named = client.post("/generate", json={**body, "token_ids_logprob": [5, 9]}).json()["meta_info"]
        assert all([t for _, t, _ in triples] == [5, 9] for triples in named["output_token_ids_logprobs"])
        assert all(
            isinstance(text, str) for triples in named["output_token_ids_logprobs"] for _, _, text in triples
        )


def test_openai_completion_and_chat_logprobs(server: LiveServer) -> None:
    client = server.openai()
    model = client.models.list().data[0].id
    full = client.completions.create(
        model=model, prompt="def main():", max_tokens=5, temperature=0, logprobs=2
    )
    lp = full.choices[0].logprobs
    assert (
        lp is not None
        and lp.tokens is not None
        and lp.token_logprobs is not None
        and lp.top_logprobs is not None
    )
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(len(top) <= 2 for top in lp.top_logprobs) and lp.text_offset is not None
    assert lp.text_offset[0] == 0

    streamed = client.completions.create(
        model=model, prompt="def main():", max_tokens=5, temperature=0, logprobs=2, stream=True
    )
    tokens: list[Any] = []
    for chunk in streamed:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            tokens += chunk.choices[0].logprobs.tokens or []
    assert tokens == lp.tokens

    messages: Any = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(
        model=model, messages=messages, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and 1 <= len(content) <= 4
    assert all(len(c.top_logprobs) == 3 and c.logprob <= 0 for c in content)


def test_penalties_and_logit_bias_change_the_output(server: LiveServer) -> None:
    client = server.openai()
    model = client.models.list().data[0].id
    plain = client.completions.create(model=model, prompt="a a a a", max_tokens=8, temperature=0)
    first = plain.choices[0].text
    with server.client() as http:
        ids = http.post(
            "/generate", json={"text": "a a a a", "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        ).json()
        banned = ids["output_ids"][0]
    biased = client.completions.create(
        model=model, prompt="a a a a", max_tokens=8, temperature=0, logit_bias={str(banned): -100}
    )
    assert biased.choices[0].text != first
    penalized = client.completions.create(
        model=model,
        prompt="a a a a",
        max_tokens=8,
        temperature=0,
        frequency_penalty=2.0,
        presence_penalty=2.0,
    )
    assert penalized.choices[0].finish_reason is not None


def test_echo_with_logprobs_scores_the_prompt(server: LiveServer) -> None:
    client = server.openai()
    model = client.models.list().data[0].id
    for max_tokens in (0, 1):
        out = client.completions.create(
            model=model, prompt=[5, 6, 7, 8], max_tokens=max_tokens, echo=True, logprobs=1, temperature=0
        )
        lp = out.choices[0].logprobs
        assert lp is not None and lp.token_logprobs is not None and lp.tokens is not None
        assert len(lp.tokens) == 4 + max_tokens and lp.token_logprobs[0] is None
        assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
        assert out.choices[0].text.startswith("".join(lp.tokens[:4]))
    streamed = client.completions.create(
        model=model, prompt=[5, 6, 7, 8], max_tokens=2, echo=True, logprobs=1, temperature=0, stream=True
    )
    tokens: list[Any] = []
    for chunk in streamed:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            tokens += chunk.choices[0].logprobs.tokens or []
    assert len(tokens) == 6
