"""Prefill/decode disaggregation flags (SGLang's names), their checks and their command-line form.

A prefill server computes prompts and hands their K/V to a decode server, which decodes from there
(scheduler/disaggregation/, distributed/kv_transfer.py). sglang-router --pd-disaggregation sends
each request to one of each, with the bootstrap fields that pair the two halves."""

from __future__ import annotations

import argparse
from typing import Protocol

MODES: tuple[str, ...] = ("null", "prefill", "decode")
# The transports a handoff can run over. torch.distributed's gloo runs on any machine; Mooncake
# and NIXL need a CUDA runtime and RDMA libraries, which this build does not ship.
TRANSFER_BACKENDS: tuple[str, ...] = ("gloo",)
NOT_AVAILABLE_BACKENDS: tuple[str, ...] = ("mooncake", "nixl", "ascend", "nccl")
DEFAULT_BOOTSTRAP_PORT = 8998
# How long either side waits for the other (a decode server for a prompt's K/V; a prefill
# server for the decode server to claim a finished prompt) before it gives the request up.
DEFAULT_TIMEOUT_S = 300.0


class DisaggregationFields(Protocol):
    disaggregation_mode: str
    disaggregation_bootstrap_port: int
    disaggregation_transfer_backend: str
    disaggregation_timeout: float
    tp_size: int
    pp_size: int
    dp_size: int
    nnodes: int
    is_embedding: bool


def validate_disaggregation_args(args: DisaggregationFields, error: type[ValueError]) -> None:
    if args.disaggregation_mode not in MODES:
        raise error(
            f"--disaggregation-mode must be one of {', '.join(MODES)}, got {args.disaggregation_mode!r}"
        )
    backend = args.disaggregation_transfer_backend
    if backend in NOT_AVAILABLE_BACKENDS:
        raise error(
            f"--disaggregation-transfer-backend {backend} is not available in this build (it needs a "
            f"CUDA runtime and its own libraries); use: {', '.join(TRANSFER_BACKENDS)}"
        )
    if backend not in TRANSFER_BACKENDS:
        raise error(f"--disaggregation-transfer-backend must be one of {', '.join(TRANSFER_BACKENDS)}")
    if not 0 < args.disaggregation_bootstrap_port < 65536:
        raise error("--disaggregation-bootstrap-port must be in 1..65535")
    if args.disaggregation_timeout <= 0:
        raise error("--disaggregation-timeout must be > 0")
    if args.disaggregation_mode == "null":
        return
    if args.tp_size != 1 or args.pp_size != 1 or args.dp_size != 1 or args.nnodes != 1:
        raise error(
            "--disaggregation-mode runs one rank per server for now: --tp-size, --pp-size, --dp-size "
            "and --nnodes must be 1 (run more servers behind sglang-router instead)"
        )
    if args.is_embedding:
        raise error("--disaggregation-mode serves generation; an embedding model has nothing to decode")


def missing_bootstrap(mode: str) -> str:
    """What a server of one half says to a request that did not come through a PD router."""
    return (
        f"this is a {mode} server (--disaggregation-mode {mode}): send requests through sglang-router "
        "--pd-disaggregation, which adds bootstrap_host, bootstrap_port and bootstrap_room"
    )


def add_disaggregation_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("prefill/decode disaggregation")
    group.add_argument(
        "--disaggregation-mode",
        choices=MODES,
        help="prefill: compute prompts and send their K/V; decode: receive K/V and decode (null: both)",
    )
    group.add_argument(
        "--disaggregation-bootstrap-port",
        type=int,
        help="a prefill server's rendezvous port (a torch.distributed TCPStore) that decode servers join",
    )
    group.add_argument(
        "--disaggregation-transfer-backend",
        help="how K/V travels: gloo (torch.distributed point-to-point)",
    )
    group.add_argument(
        "--disaggregation-timeout",
        type=float,
        help="seconds either side waits for the other before giving a request up",
    )
