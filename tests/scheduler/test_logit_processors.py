"""Custom logit processors: loading by name only when enabled, batched application, and failures
that stay with their own requests. (The Engine path: tests/engine/test_logit_processors.py.)"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from radixserve.protocol.sampling_params import InvalidRequestError
from radixserve.scheduler.logit_processors import DisallowedTokens, ProcessorRegistry, apply_processors

BUILTIN = "radixserve.scheduler.logit_processors:DisallowedTokens"


class Broken:
    def __call__(self, logits: torch.Tensor, params: list[dict[str, Any]]) -> torch.Tensor:
        raise ValueError("broken on purpose")


class CountingBoost:
    """Adds custom_params["boost"] to token 7; counts its calls (one per step for all its rows)."""

    calls = 0

    def __call__(self, logits: torch.Tensor, params: list[dict[str, Any]]) -> torch.Tensor:
        CountingBoost.calls += 1
        logits[:, 7] += torch.tensor([p.get("boost", 0.0) for p in params])
        return logits


def test_registry_loads_only_when_enabled_and_by_module_and_class() -> None:
    with pytest.raises(InvalidRequestError, match="--enable-custom-logit-processor"):
        ProcessorRegistry(enabled=False).get(BUILTIN)
    registry = ProcessorRegistry(enabled=True)
    assert isinstance(registry.get(BUILTIN), DisallowedTokens)
    assert registry.get(BUILTIN) is registry.get(BUILTIN)  # instantiated once
    for bad, message in [("no_colon", "module.path:ClassName"), ("nope.module:X", "cannot load")]:
        with pytest.raises(InvalidRequestError, match=message):
            registry.get(bad)


def test_apply_groups_rows_by_processor_and_keeps_the_raw_logits() -> None:
    logits = torch.zeros(4, 10)
    boost, ban = CountingBoost(), DisallowedTokens()
    CountingBoost.calls = 0
    out = apply_processors(
        logits, [boost, None, boost, ban], [{"boost": 2.0}, None, {"boost": 5.0}, {"token_ids": [1, 2]}]
    )
    assert CountingBoost.calls == 1
    assert out.errors == [None] * 4
    assert out.logits[0, 7] == 2.0 and out.logits[2, 7] == 5.0 and out.logits[1].eq(0).all()
    assert out.logits[3, 1] == float("-inf") and out.logits[3, 2] == float("-inf")
    assert logits.eq(0).all()  # untouched: logprobs come from it


def test_a_failing_processor_fails_only_its_rows() -> None:
    logits = torch.zeros(3, 10)
    out = apply_processors(logits, [Broken(), None, DisallowedTokens()], [None, None, {"token_ids": [4]}])
    assert out.errors[0] is not None and "broken on purpose" in out.errors[0]
    assert out.errors[1:] == [None, None]
    assert out.logits[2, 4] == float("-inf")
