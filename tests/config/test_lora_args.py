"""The LoRA flags: --lora-paths' three forms, what turns LoRA on, and what is refused."""

from __future__ import annotations

import pytest

from radixserve.config.lora_args import LORA_TARGET_MODULES, LoraRef, parse_lora_ref
from radixserve.config.server_args import InvalidArgumentError, ServerArgs


def test_lora_paths_take_sglangs_three_forms() -> None:
    assert parse_lora_ref("/adapters/sql", ValueError) == LoraRef("sql", "/adapters/sql")
    assert parse_lora_ref("mine=/adapters/sql", ValueError) == LoraRef("mine", "/adapters/sql")
    spec = '{"lora_name": "j", "lora_path": "/a/j", "pinned": true}'
    assert parse_lora_ref(spec, ValueError) == LoraRef("j", "/a/j")
    with pytest.raises(ValueError, match="JSON object"):
        parse_lora_ref('{"lora_name": "j"}', ValueError)


def test_lora_paths_turn_lora_on_and_target_modules_are_checked() -> None:
    args = ServerArgs(lora_paths=["a=/x"], lora_target_modules=["all"])
    assert args.enable_lora
    assert args.lora_target_modules == list(LORA_TARGET_MODULES)
    with pytest.raises(InvalidArgumentError, match="twice"):
        ServerArgs(lora_paths=["a=/x", "a=/y"])
    with pytest.raises(InvalidArgumentError, match="embed_tokens"):
        ServerArgs(enable_lora=True, max_lora_rank=8, lora_target_modules=["embed_tokens"])
    with pytest.raises(InvalidArgumentError, match="needs --max-lora-rank"):
        ServerArgs(enable_lora=True)
    with pytest.raises(InvalidArgumentError, match="--max-loras-per-batch"):
        ServerArgs(lora_paths=["a=/x"], max_loras_per_batch=0)
    with pytest.raises(InvalidArgumentError, match="--speculative-algorithm"):
        ServerArgs(lora_paths=["a=/x"], speculative_algorithm="NGRAM")
