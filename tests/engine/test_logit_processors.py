"""Custom logit processors through the Engine: off unless enabled, applied per request, and a
failing processor ends only its own request."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from radixserve.protocol.sampling_params import InvalidRequestError
from radixserve.runtime.engine import Engine

BUILTIN = "radixserve.scheduler.logit_processors:DisallowedTokens"
# Imported by the scheduler process by name: it runs with the repository root on its path.
BROKEN = "tests.scheduler.test_logit_processors:Broken"


def test_engine_applies_processors_per_request(
    tiny_model_dir: Callable[[str], Path], make_engine: Callable[..., Engine]
) -> None:
    path = tiny_model_dir("llama")
    greedy = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
    plain_engine = make_engine(path)
    with pytest.raises(InvalidRequestError, match="--enable-custom-logit-processor"):
        plain_engine.generate(input_ids=[5, 6, 7], sampling_params=greedy, custom_logit_processor=BUILTIN)
    plain = plain_engine.generate(input_ids=[5, 6, 7], sampling_params=greedy)
    assert isinstance(plain, dict)

    engine = make_engine(path, enable_custom_logit_processor=True)
    banned = sorted(set(plain["output_ids"]))
    outs = engine.generate(
        input_ids=[[5, 6, 7], [5, 6, 7], [5, 6, 7]],
        sampling_params=[greedy, {**greedy, "custom_params": {"token_ids": banned}}, greedy],
        custom_logit_processor=BUILTIN,
    )
    assert isinstance(outs, list)
    # No custom_params: the processor leaves the row alone. With them: none of the banned tokens.
    assert outs[0]["output_ids"] == outs[2]["output_ids"] == plain["output_ids"]
    assert not set(outs[1]["output_ids"]) & set(banned)

    broken = engine.generate(input_ids=[5, 6, 7], sampling_params=greedy, custom_logit_processor=BROKEN)
    assert isinstance(broken, dict)
    finish = broken["meta_info"]["finish_reason"]
    assert finish["type"] == "abort" and "broken on purpose" in finish["message"]
    again = engine.generate(input_ids=[5, 6, 7], sampling_params=greedy)
    assert isinstance(again, dict) and again["output_ids"] == plain["output_ids"]
