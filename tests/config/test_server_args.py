"""ServerArgs (config/server_args.py): the native-kernel settings, other flags, and defaults written once."""

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


def test_pipeline_parallelism_flags_and_what_they_refuse() -> None:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(
        parser.parse_args(["--model-path", "m", "--pipeline-parallel-size", "2", "--tp-size", "2"])
    )
    assert (args.pp_size, args.model_ranks, args.ranks_per_node) == (2, 4, 4)
    with pytest.raises(InvalidArgumentError, match="--pp-size must be >= 1"):
        ServerArgs(model_path="m", pp_size=0)
    for fields, flag in (
        ({"dp_size": 2}, "--dp-size"),
        ({"speculative_algorithm": "NGRAM"}, "--speculative-algorithm"),
        ({"enable_hierarchical_cache": True}, "--enable-hierarchical-cache"),
    ):
        with pytest.raises(InvalidArgumentError, match=f"--pp-size > 1 does not run with {flag}"):
            ServerArgs(model_path="m", pp_size=2, **fields)  # type: ignore[arg-type]
    with pytest.raises(
        InvalidArgumentError, match=r"--tp-size x --pp-size \(3\) must be a multiple of --nnodes"
    ):
        ServerArgs(model_path="m", pp_size=3, nnodes=2, dist_init_addr="127.0.0.1:5000")


def test_the_command_lines_defaults_are_the_dataclass_fields() -> None:
    """Defaults are written once, on the fields: a command line without flags is ServerArgs()."""
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert ServerArgs.from_cli_args(parser.parse_args([])) == ServerArgs()
    parsed = vars(parser.parse_args([]))
    assert all(parsed[name] == value for name, value in ServerArgs.defaults().items())
    assert ServerArgs.from_cli_args(parser.parse_args(["--kv-cache-dtype", "bf16"])).kv_cache_dtype == "bf16"


def test_swa_full_tokens_ratio_parses_and_is_checked() -> None:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    flags = ["--model-path", "m", "--swa-full-tokens-ratio", "0.25"]
    args = ServerArgs.from_cli_args(parser.parse_args(flags))
    assert args.swa_full_tokens_ratio == 0.25
    assert ServerArgs(model_path="m").swa_full_tokens_ratio == 0.8  # SGLang's default
    for bad in (0.0, 1.5):
        with pytest.raises(InvalidArgumentError, match=r"--swa-full-tokens-ratio must be in \(0, 1\]"):
            ServerArgs(model_path="m", swa_full_tokens_ratio=bad)
