"""Embeddings through the offline Engine: an encoder (all-MiniLM-L6-v2, mean pooling) and a
decoder under --is-embedding (last-token pooling), against transformers with the same pooling."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoTokenizer

from radixserve.protocol.sampling_params import InvalidRequestError
from radixserve.runtime.engine import Engine

WORDS = ["the", "a", "cat", "dog", "runs", "quickly", "over", "under", "bright", "dark", "river",
         "mountain", "code", "server", "token", "cache"]  # fmt: skip


def mixed_texts(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 120))) for _ in range(count)]


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.double(), b.double(), dim=0))


def test_minilm_matches_transformers_mean_pooling_on_a_mixed_batch(
    minilm_path: Path, make_engine: Callable[..., Engine]
) -> None:
    texts = mixed_texts(64)
    engine = make_engine(minilm_path)
    assert engine.is_embedding
    results = engine.encode(texts)
    assert isinstance(results, list) and len(results) == 64
    stats = engine.get_stats()
    assert stats["prefill_batches"] < 64, "the texts should share prefill batches"

    tokenizer = AutoTokenizer.from_pretrained(minilm_path)
    model = AutoModel.from_pretrained(minilm_path, dtype=torch.float32).eval()
    for text, result in zip(texts, results, strict=True):
        encoded = tokenizer(text, return_tensors="pt")
        with torch.no_grad():
            hidden = model(**encoded).last_hidden_state[0]
        expected = F.normalize(hidden.mean(0), dim=0)  # 1_Pooling: mean; 2_Normalize
        got = torch.tensor(result["embedding"])
        assert got.shape == (384,)
        assert result["meta_info"]["prompt_tokens"] == encoded.input_ids.shape[1]
        assert cosine(got, expected) > 1 - 1e-5
        assert torch.allclose(got, expected, atol=1e-5)


def test_single_text_and_token_ids_give_the_same_embedding(
    minilm_path: Path, make_engine: Callable[..., Engine]
) -> None:
    engine = make_engine(minilm_path)
    one = engine.encode("radix trees share prefixes")
    assert isinstance(one, dict)
    ids = engine.tokenize("radix trees share prefixes")
    again = engine.encode(input_ids=ids)
    assert isinstance(again, dict)
    assert again["embedding"] == one["embedding"]


def test_decoder_is_embedding_uses_the_last_tokens_normed_hidden_state(
    tiny_model_dir: Callable[[str], Path], make_engine: Callable[..., Engine]
) -> None:
    path = tiny_model_dir("llama")
    base = "def main(args):\n    return " * 6
    # Shared prefixes (radix cache hits) and prompts long enough to be prefilled in chunks.
    texts = [base + "x", base + "y = 1", base * 3, "hello"]
    engine = make_engine(path, is_embedding=True, chunked_prefill_size=32)
    first = engine.encode(texts)
    second = engine.encode(texts)  # now mostly served from the cache
    assert isinstance(first, list) and isinstance(second, list)

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    for text, a, b in zip(texts, first, second, strict=True):
        ids = tokenizer(text, return_tensors="pt").input_ids
        with torch.no_grad():
            last = model(input_ids=ids).last_hidden_state[0, -1]
        expected = F.normalize(last, dim=0)
        for result in (a, b):
            got = torch.tensor(result["embedding"])
            assert cosine(got, expected) > 1 - 1e-5
            assert torch.allclose(got, expected, atol=1e-4)
    assert engine.get_stats()["cached_tokens"] > 0


def test_embedding_and_generation_models_refuse_each_others_requests(
    minilm_path: Path, tiny_model_dir: Callable[[str], Path], make_engine: Callable[..., Engine]
) -> None:
    embedder = make_engine(minilm_path)
    with pytest.raises(InvalidRequestError, match="embedding model"):
        embedder.generate("hello", {"max_new_tokens": 2})
    with pytest.raises(InvalidRequestError, match="context length"):
        embedder.encode(input_ids=[101] * 600)
    generator = make_engine(tiny_model_dir("llama"))
    with pytest.raises(InvalidRequestError, match="does not serve embeddings"):
        generator.encode("hello")
    # Both still serve what they serve.
    assert isinstance(embedder.encode("still here"), dict)
    out = generator.generate("hello", {"max_new_tokens": 2, "temperature": 0})
    assert isinstance(out, dict) and out["meta_info"]["completion_tokens"] == 2
