"""The prefill/decode disaggregation flags (SGLang's names): the command line and what is refused."""

from __future__ import annotations

import argparse

import pytest

from radixserve.config.server_args import InvalidArgumentError, ServerArgs


def test_the_command_line_takes_sglang_s_flags() -> None:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(
        ["--model-path", "m", "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "9001",
         "--disaggregation-transfer-backend", "gloo", "--disaggregation-timeout", "30"]
    )  # fmt: skip
    args = ServerArgs.from_cli_args(ns)
    assert (args.disaggregation_mode, args.disaggregation_bootstrap_port) == ("prefill", 9001)
    assert (args.disaggregation_transfer_backend, args.disaggregation_timeout) == ("gloo", 30.0)
    # SGLang's defaults: no disaggregation, bootstrap port 8998.
    plain = ServerArgs.from_cli_args(parser.parse_args(["--model-path", "m"]))
    assert (plain.disaggregation_mode, plain.disaggregation_bootstrap_port) == ("null", 8998)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"disaggregation_mode": "both"}, "--disaggregation-mode must be one of"),
        ({"disaggregation_transfer_backend": "mooncake"}, "not available in this build"),
        ({"disaggregation_transfer_backend": "tcp"}, "must be one of gloo"),
        ({"disaggregation_bootstrap_port": 0}, "1..65535"),
        ({"disaggregation_timeout": 0}, "must be > 0"),
        ({"disaggregation_mode": "decode", "tp_size": 2}, "one rank per server"),
        ({"disaggregation_mode": "prefill", "dp_size": 2}, "one rank per server"),
        ({"disaggregation_mode": "prefill", "is_embedding": True}, "nothing to decode"),
    ],
)
def test_what_cannot_run_is_refused_at_startup(fields: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        ServerArgs(model_path="m", **fields)  # type: ignore[arg-type]
