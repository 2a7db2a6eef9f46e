"""Embeddings over HTTP: OpenAI's /v1/embeddings (through the official client) and native /encode,
on the packaged all-MiniLM-L6-v2; and the clear refusals on both kinds of server."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import openai
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoTokenizer

from tests.server.conftest import LiveServer

TEXTS = ["The cat sat on the mat.", "Radix trees share prefixes between requests.", "ok"]


@pytest.fixture(scope="module")
def reference(minilm_path: Path) -> Callable[[str], torch.Tensor]:
    tokenizer = AutoTokenizer.from_pretrained(minilm_path)
    model = AutoModel.from_pretrained(minilm_path, dtype=torch.float32).eval()

    def embed(text: str) -> torch.Tensor:
        with torch.no_grad():
            hidden = model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0]
        return F.normalize(hidden.mean(0), dim=0)

    return embed


def assert_close(got: list[float], expected: torch.Tensor) -> None:
    vector = torch.tensor(got)
    assert float(F.cosine_similarity(vector.double(), expected.double(), dim=0)) > 1 - 1e-5
    assert torch.allclose(vector, expected, atol=1e-5)


def test_openai_client_embeddings_create(
    embed_server: LiveServer, reference: Callable[[str], torch.Tensor]
) -> None:
    client = embed_server.openai()
    model = client.models.list().data[0].id
    # The client asks for base64 by default and decodes it; float is asked for explicitly.
    for encoding in (openai.NOT_GIVEN, "float"):
        response = client.embeddings.create(model=model, input=TEXTS, encoding_format=encoding)
        assert [d.index for d in response.data] == [0, 1, 2]
        for text, item in zip(TEXTS, response.data, strict=True):
            assert_close(item.embedding, reference(text))
        assert response.usage.prompt_tokens == response.usage.total_tokens > len(TEXTS)
    single = client.embeddings.create(model=model, input=TEXTS[0])
    assert len(single.data) == 1
    assert_close(single.data[0].embedding, reference(TEXTS[0]))


def test_native_encode(embed_server: LiveServer, reference: Callable[[str], torch.Tensor]) -> None:
    with embed_server.client() as client:
        one = client.post("/encode", json={"text": TEXTS[1], "rid": "e-1"}).json()
        assert one["meta_info"]["id"] == "e-1"
        assert_close(one["embedding"], reference(TEXTS[1]))
        many = client.post("/encode", json={"text": TEXTS}).json()
        assert len(many) == 3
        for text, result in zip(TEXTS, many, strict=True):
            assert_close(result["embedding"], reference(text))
        ids = client.post("/encode", json={"input_ids": [101, 7592, 2088, 102]}).json()
        assert len(ids["embedding"]) == 384 and ids["meta_info"]["prompt_tokens"] == 4
        assert client.get("/get_model_info").json()["is_generation"] is False
        assert client.get("/health_generate").status_code == 200


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/v1/embeddings", {"input": TEXTS[0], "dimensions": 64}, "dimensions"),
        ("/v1/embeddings", {"input": []}, "empty"),
        ("/v1/embeddings", {"input": [[101, 10**6]]}, "token ids"),
        ("/v1/embeddings", {"input": [[101] * 600]}, "context length"),
        ("/v1/embeddings", {"input": "x", "model": "other"}, "does not exist"),
        ("/encode", {}, "exactly one"),
        ("/generate", {"text": "hi"}, "embedding model"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}, "embedding model"),
    ],
)
def test_bad_embedding_requests_get_a_clear_4xx(
    embed_server: LiveServer, path: str, body: dict, message: str
) -> None:
    with embed_server.client() as client:
        response = client.post(path, json=body)
        assert 400 <= response.status_code < 500, response.text
        assert message in response.json()["error"]["message"]
        # Still serving.
        assert client.post("/encode", json={"text": "still here"}).status_code == 200
