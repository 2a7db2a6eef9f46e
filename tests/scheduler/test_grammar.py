"""GrammarBackend: compile, cache, failures, and the allowed-token masks."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from radixserve.protocol.sampling_params import InvalidRequestError, SamplingParams
from radixserve.scheduler.grammar import GrammarBackend, grammar_key


@pytest.fixture(scope="module")
def backend(tiny_tokenizer: Any) -> GrammarBackend:
    return GrammarBackend(tiny_tokenizer, vocab_size=len(tiny_tokenizer) + 3)


def test_grammar_key_and_validation() -> None:
    assert grammar_key(SamplingParams()) is None
    assert grammar_key(SamplingParams(regex="a+")) == ("regex", "a+")
    with pytest.raises(InvalidRequestError, match="at most one"):
        SamplingParams.from_dict({"regex": "a", "json_schema": "{}"})


def test_compiles_are_cached_and_failures_too(backend: GrammarBackend) -> None:
    first = backend.compile(("regex", "[ab]+"))
    assert backend.compile(("regex", "[ab]+")) is first and first.result().grammar is not None
    bad = backend.compile(("json_schema", "{oops"))
    assert bad.result().error is not None and bad.result().error.startswith("invalid json_schema")
    assert backend.compile(("json_schema", "{oops")) is bad


def test_masks_follow_the_grammar(backend: GrammarBackend, tiny_tokenizer: Any) -> None:
    compiled = backend.compile(("regex", "ab")).result().grammar
    matcher = backend.matcher(compiled, "regex")
    allowed = backend.bitmask([matcher, None], torch.device("cpu"))
    assert allowed.shape == (2, backend.vocab_size)
    assert bool(allowed[1].all())  # an unconstrained row may take anything
    first_ok = [t for t in range(len(tiny_tokenizer)) if allowed[0, t]]
    assert first_ok and all("ab".startswith(tiny_tokenizer.decode([t])) for t in first_ok)
    token = tiny_tokenizer.encode("ab", add_special_tokens=False)
    for t in token:
        assert matcher.accept(t)
    assert not matcher.terminated  # the grammar is complete, but only a stop token ends it
    eos = [t for t in range(backend.vocab_size) if backend.bitmask([matcher], torch.device("cpu"))[0, t]]
    assert eos == [tiny_tokenizer.eos_token_id]
    assert matcher.accept(eos[0]) and matcher.terminated


def test_json_rows_never_take_control_characters(backend: GrammarBackend) -> None:
    compiled = backend.compile(("json_schema", json.dumps({"type": "string"}))).result().grammar
    matcher = backend.matcher(compiled, "json_schema")
    assert matcher.accept(backend._tokenizer.encode('"', add_special_tokens=False)[0])
    allowed = backend.bitmask([matcher], torch.device("cpu"))[0]
    assert not bool((allowed & backend.control_tokens).any())
