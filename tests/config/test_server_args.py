"""ServerArgs validation (config/server_args.py) of the native-kernel settings."""

from __future__ import annotations

import argparse

import pytest

from radixserve.config.server_args import InvalidArgumentError, ServerArgs


def test_cpu_isa_choices_are_checked() -> None:
    for isa in ("auto", "amx", "avx512_bf16", "avx512", "avx2"):
        assert ServerArgs(model_path="m", cpu_isa=isa).cpu_isa == isa
    with pytest.raises(InvalidArgumentError, match="--cpu-isa must be one of auto, amx, "):
        ServerArgs(model_path="m", cpu_isa="sse2")


def test_cpu_isa_needs_the_native_kernels() -> None:
    with pytest.raises(InvalidArgumentError, match="--cpu-isa avx2 needs the native kernels"):
        ServerArgs(model_path="m", cpu_isa="avx2", cpu_kernels="torch")
    assert ServerArgs(model_path="m", cpu_kernels="torch").cpu_isa == "auto"


def test_cpu_isa_flag_parses() -> None:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(["--model-path", "m", "--cpu-isa", "avx512"]))
    assert args.cpu_isa == "avx512"
    assert ServerArgs.from_cli_args(parser.parse_args(["--model-path", "m"])).cpu_isa == "auto"
