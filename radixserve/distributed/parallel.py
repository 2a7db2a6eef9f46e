"""Tensor parallelism: the process group of one model's ranks and the collectives its layers use.

Every rank runs its own scheduler process over a shard of the weights (see docs/parallelism.md).
The group is torch.distributed's: gloo on a CPU, NCCL on CUDA, plus a gloo group on CUDA for the
scheduler's CPU-side messages. Only tensors cross it (never pickled objects).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from radixserve.config.server_args import parse_host_port

# How long a rank waits in a collective for the others. Rank 0 broadcasts at least every idle
# wake-up (seconds apart), and a forward step is far shorter than this; it bounds a hang instead.
COLLECTIVE_TIMEOUT_S = 1800


class DistributedInitError(RuntimeError):
    """The ranks of a tensor-parallel model could not form their group."""


@dataclass(frozen=True, eq=False)
class ParallelContext:
    """This rank's place in its tensor-parallel group. `group` carries the model's collectives (on
    its device); `cpu_group` carries the scheduler's (host tensors). Both are None for tp 1."""

    tp_rank: int = 0
    tp_size: int = 1
    group: Any = None
    cpu_group: Any = None

    @property
    def is_leader(self) -> bool:
        return self.tp_rank == 0


SINGLE = ParallelContext()


def init_tensor_parallel(tp_rank: int, tp_size: int, init_addr: str, device: torch.device) -> ParallelContext:
    """Joins the group of tp_size ranks whose rank 0 listens at init_addr ('host:port')."""
    if tp_size == 1:
        return SINGLE
    host, port = parse_host_port(init_addr)
    backend = "nccl" if device.type == "cuda" else "gloo"
    try:
        dist.init_process_group(
            backend,
            init_method=f"tcp://{host}:{port}",
            rank=tp_rank,
            world_size=tp_size,
            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
            device_id=device if device.type == "cuda" else None,
        )
    except (RuntimeError, ValueError, OSError) as exc:
        raise DistributedInitError(
            f"tensor-parallel rank {tp_rank}/{tp_size} could not join the group at {host}:{port}: {exc}"
        ) from exc
    group = dist.group.WORLD
    cpu_group = group if backend == "gloo" else dist.new_group(backend="gloo")
    return ParallelContext(tp_rank, tp_size, group, cpu_group)


def all_reduce(x: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """Sums x over the ranks, in place."""
    if ctx.tp_size > 1:
        dist.all_reduce(x, group=ctx.group)
    return x


def gather_last_dim(local: torch.Tensor, full_size: int, ctx: ParallelContext) -> torch.Tensor:
    """Concatenates every rank's slice along the last dim; a shorter last slice is padded to the
    common width for the collective and the padding cut off again."""
    if ctx.tp_size == 1:
        return local
    width = -(-full_size // ctx.tp_size)
    padded = torch.nn.functional.pad(local, (0, width - local.shape[-1])).contiguous()
    pieces = [torch.empty_like(padded) for _ in range(ctx.tp_size)]
    dist.all_gather(pieces, padded, group=ctx.group)
    return torch.cat(pieces, dim=-1)[..., :full_size]


def gather_shards(local: torch.Tensor, dim: int, start: int, full: int, ctx: ParallelContext) -> torch.Tensor:
    """The whole tensor from every rank's slice [start, start + len) along dim; slices that ranks
    hold in copies (replicated KV heads) land on the same place."""
    places = [torch.empty(2, dtype=torch.int64) for _ in range(ctx.tp_size)]
    dist.all_gather(places, torch.tensor([start, local.shape[dim]]), group=ctx.cpu_group)
    width = max(int(p[1]) for p in places)
    pad = [0, 0] * (local.dim() - 1 - dim) + [0, width - local.shape[dim]]
    padded = torch.nn.functional.pad(local, pad).contiguous()
    pieces = [torch.empty_like(padded) for _ in range(ctx.tp_size)]
    dist.all_gather(pieces, padded, group=ctx.group)
    shape = list(local.shape)
    shape[dim] = full
    out = local.new_empty(shape)
    for (first, length), piece in zip((p.tolist() for p in places), pieces, strict=True):
        out.narrow(dim, first, length).copy_(piece.narrow(dim, 0, length))
    return out


def broadcast_from_leader(x: torch.Tensor, ctx: ParallelContext, cpu: bool = False) -> torch.Tensor:
    """Rank 0's x on every rank (x must have the same shape and dtype everywhere)."""
    if ctx.tp_size > 1:
        dist.broadcast(x, src=0, group=ctx.cpu_group if cpu else ctx.group)
    return x


def min_over_ranks(values: list[int], ctx: ParallelContext) -> list[int]:
    """Each position's smallest value over the ranks: sizes that the ranks' schedulers must agree
    on (every rank passes as many values)."""
    if ctx.tp_size == 1:
        return values
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=ctx.cpu_group)
    least: list[int] = t.tolist()
    return least


def barrier(ctx: ParallelContext) -> None:
    if ctx.tp_size > 1:
        dist.barrier(group=ctx.cpu_group)


def destroy(ctx: ParallelContext) -> None:
    if ctx.tp_size > 1 and dist.is_initialized():
        dist.destroy_process_group()
