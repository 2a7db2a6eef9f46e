"""RunnerConfig: the part of ServerArgs the runner reads, made from one (it has no defaults)."""

from __future__ import annotations

import dataclasses

from radixserve.config.server_args import ServerArgs
from radixserve.executor.runner_config import RunnerConfig


def test_every_field_is_a_server_arg() -> None:
    """A field of ServerArgs, or a property that derives from them (window_memory_refusal)."""
    server_fields = {field.name for field in dataclasses.fields(ServerArgs)}
    derived = {name for name, value in vars(ServerArgs).items() if isinstance(value, property)}
    assert {field.name for field in dataclasses.fields(RunnerConfig)} <= server_fields | derived


def test_from_server_args_carries_each_setting() -> None:
    args = ServerArgs(
        dtype="float32",
        max_total_tokens=512,
        page_size=4,
        cpu_isa="avx2",
        enable_lora=True,
        max_lora_rank=8,
        lora_target_modules=["q_proj"],
    )
    config = RunnerConfig.from_server_args(args)
    assert (config.dtype, config.max_total_tokens, config.page_size) == ("float32", 512, 4)
    assert (config.cpu_isa, config.enable_lora, config.max_lora_rank) == ("avx2", True, 8)
    assert config.lora_target_modules == ["q_proj"]
    assert config.window_memory_refusal == "not with --page-size > 1"
    assert RunnerConfig.from_server_args(ServerArgs()).window_memory_refusal is None
