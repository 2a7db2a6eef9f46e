"""The parallelism flags (SGLang's names): tensor, pipeline and data parallelism, and the nodes the
ranks span; their checks and their command-line form."""

from __future__ import annotations

import argparse
from typing import Protocol

LOAD_BALANCE_METHODS: tuple[str, ...] = ("round_robin", "shortest_queue", "cache_aware")


class ParallelFields(Protocol):
    tp_size: int
    pp_size: int
    dp_size: int
    load_balance_method: str
    nnodes: int
    node_rank: int
    dist_init_addr: str | None
    speculative_algorithm: str | None
    enable_hierarchical_cache: bool
    is_embedding: bool

    @property
    def model_ranks(self) -> int: ...


def parse_host_port(address: str, error: type[ValueError] = ValueError) -> tuple[str, int]:
    """'host:port' or '[v6]:port' → (host, port)."""
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise error(f"--dist-init-addr must be HOST:PORT (e.g. 10.0.0.1:5000), got {address!r}")
    return host, int(port)


def validate_parallel_args(args: ParallelFields, error: type[ValueError]) -> None:
    """The parallelism flags' checks; `error` is the caller's error class."""
    if args.dp_size < 1:
        raise error(f"--dp-size must be >= 1, got {args.dp_size}")
    if args.load_balance_method not in LOAD_BALANCE_METHODS:
        methods = ", ".join(LOAD_BALANCE_METHODS)
        raise error(f"--load-balance-method must be one of {methods}, got {args.load_balance_method!r}")
    if args.tp_size < 1:
        raise error(f"--tp-size must be >= 1, got {args.tp_size}")
    if args.pp_size < 1:
        raise error(f"--pp-size must be >= 1, got {args.pp_size}")
    if args.pp_size > 1:
        not_built = [
            flag
            for flag, used in (
                ("--dp-size", args.dp_size > 1),
                ("--speculative-algorithm", args.speculative_algorithm is not None),
                ("--enable-hierarchical-cache", args.enable_hierarchical_cache),
                ("--is-embedding", args.is_embedding),
            )
            if used
        ]
        if not_built:
            raise error(f"--pp-size > 1 does not run with {', '.join(not_built)} yet")
    if args.nnodes < 1:
        raise error(f"--nnodes must be >= 1, got {args.nnodes}")
    if not 0 <= args.node_rank < args.nnodes:
        raise error(
            f"--node-rank must be in 0..{args.nnodes - 1} (--nnodes {args.nnodes}), got {args.node_rank}"
        )
    if args.dist_init_addr is not None:
        parse_host_port(args.dist_init_addr, error)
    if args.nnodes > 1:
        if args.dist_init_addr is None:
            raise error("--nnodes > 1 needs --dist-init-addr HOST:PORT: an address of node 0 all nodes reach")
        if args.model_ranks % args.nnodes:
            raise error(
                f"--tp-size x --pp-size ({args.model_ranks}) must be a multiple of --nnodes "
                f"({args.nnodes}): each node runs the same number of ranks"
            )
        if args.dp_size != 1:
            raise error("--nnodes > 1 supports --dp-size 1 only")


def add_parallel_args(parser: argparse.ArgumentParser) -> None:
    parallel = parser.add_argument_group("parallelism")
    parallel.add_argument(
        "--tp-size", "--tensor-parallel-size", dest="tp_size", type=int,
        help="ranks that split one model's weights (tensor parallelism)",
    )  # fmt: skip
    parallel.add_argument(
        "--pp-size", "--pipeline-parallel-size", dest="pp_size", type=int,
        help="pipeline stages that split one model's layers (each of --tp-size ranks)",
    )  # fmt: skip
    parallel.add_argument("--dp-size", type=int, help="scheduler replicas (data parallelism)")
    parallel.add_argument(
        "--load-balance-method",
        choices=LOAD_BALANCE_METHODS,
        help="how requests are spread over the --dp-size replicas",
    )
    parallel.add_argument("--nnodes", type=int, help="machines the --tp-size ranks span")
    parallel.add_argument("--node-rank", type=int, help="this machine's index, 0..nnodes-1")
    parallel.add_argument(
        "--dist-init-addr",
        help="HOST:PORT where the ranks meet (node 0's address; default: a free local port)",
    )
