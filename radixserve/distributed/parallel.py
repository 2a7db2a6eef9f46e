"""Tensor and pipeline parallelism: the process groups of one model's ranks and their collectives.

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

from radixserve.config.parallel_args import parse_host_port

# How long a rank waits in a collective for the others. Rank 0 broadcasts at least every idle
# wake-up (seconds apart), and a forward step is far shorter than this; it bounds a hang instead.
COLLECTIVE_TIMEOUT_S = 1800


class DistributedInitError(RuntimeError):
    """The ranks of a tensor-parallel model could not form their group."""


@dataclass(frozen=True, eq=False)
class ParallelContext:
    """This rank's place among the ranks of one model: tp_size ranks per pipeline stage, pp_size
    stages. `group` carries the tensor-parallel collectives of its stage (on its device) and
    `cpu_group` their host-side twin; `world_group` / `world_cpu_group` span every rank of the
    model (the schedulers' agreement, the sampled tokens, the last stage's logits). For one stage
    the world groups are the stage's own. All are None for a single rank."""

    tp_rank: int = 0
    tp_size: int = 1
    group: Any = None
    cpu_group: Any = None
    pp_rank: int = 0
    pp_size: int = 1
    world_group: Any = None
    world_cpu_group: Any = None

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def rank(self) -> int:
        """The rank among all of the model's: stage by stage, tensor-parallel ranks within."""
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def is_leader(self) -> bool:
        """Rank 0, which receives the requests, samples, and answers for the group."""
        return self.rank == 0

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


SINGLE = ParallelContext()


def stage_layers(num_layers: int, ctx: ParallelContext) -> range:
    """The layers this rank's pipeline stage holds: contiguous, the first stages taking one more
    where they do not divide evenly."""
    if num_layers < ctx.pp_size:
        raise ValueError(f"{num_layers} layers cannot be split over --pp-size {ctx.pp_size} stages")
    base, extra = divmod(num_layers, ctx.pp_size)
    start = ctx.pp_rank * base + min(ctx.pp_rank, extra)
    return range(start, start + base + (1 if ctx.pp_rank < extra else 0))


def init_model_parallel(
    rank: int, tp_size: int, pp_size: int, init_addr: str, device: torch.device
) -> ParallelContext:
    """Joins the group of tp_size x pp_size ranks whose rank 0 listens at init_addr ('host:port'):
    rank r is tensor-parallel rank r % tp_size of pipeline stage r // tp_size."""
    world = tp_size * pp_size
    if world == 1:
        return SINGLE
    host, port = parse_host_port(init_addr)
    backend = "nccl" if device.type == "cuda" else "gloo"
    try:
        dist.init_process_group(
            backend,
            init_method=f"tcp://{host}:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
            device_id=device if device.type == "cuda" else None,
        )
    except (RuntimeError, ValueError, OSError) as exc:
        raise DistributedInitError(
            f"rank {rank} of {world} (--tp-size {tp_size}, --pp-size {pp_size}) could not join the "
            f"group at {host}:{port}: {exc}"
        ) from exc
    world_group = dist.group.WORLD
    world_cpu_group = world_group if backend == "gloo" else dist.new_group(backend="gloo")
    tp_rank, pp_rank = rank % tp_size, rank // tp_size
    if pp_size == 1:
        return ParallelContext(
            tp_rank, tp_size, world_group, world_cpu_group, 0, 1, world_group, world_cpu_group
        )
    # Every rank creates every stage's groups, in the same order (torch.distributed's rule).
    group = cpu_group = None
    for stage in range(pp_size):
        ranks = list(range(stage * tp_size, (stage + 1) * tp_size))
        device_group = dist.new_group(ranks)
        host_group = device_group if backend == "gloo" else dist.new_group(ranks, backend="gloo")
        if stage == pp_rank:
            group, cpu_group = device_group, host_group
    return ParallelContext(tp_rank, tp_size, group, cpu_group, pp_rank, pp_size, world_group, world_cpu_group)


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
    """Rank 0's x on every rank of the model (x must have the same shape and dtype everywhere)."""
    if ctx.world_size > 1:
        dist.broadcast(x, src=0, group=ctx.world_cpu_group if cpu else ctx.world_group)
    return x


def broadcast_from_last_stage(x: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """The last pipeline stage's x (its first tensor-parallel rank's) on every rank; the others pass
    a tensor of the same shape and dtype to receive into."""
    if ctx.pp_size > 1:
        dist.broadcast(x, src=(ctx.pp_size - 1) * ctx.tp_size, group=ctx.world_group)
    return x


def send_to_next_stage(x: torch.Tensor, ctx: ParallelContext) -> None:
    """x to the same tensor-parallel rank of the next pipeline stage."""
    dist.send(x.contiguous(), dst=ctx.rank + ctx.tp_size, group=ctx.world_group)


def start_send_to_next_stage(x: torch.Tensor, ctx: ParallelContext) -> Any:
    """x to the next stage without waiting for it to be received: a micro-batch's hidden states,
    which the next stage takes at its next tick, after collectives this stage must join first.
    Returns the send's handle; the caller keeps x alive and waits on the handle before reusing it."""
    return dist.isend(x.contiguous(), dst=ctx.rank + ctx.tp_size, group=ctx.world_group)


def receive_from_previous_stage(x: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """What the same tensor-parallel rank of the previous stage sent, into x."""
    dist.recv(x, src=ctx.rank - ctx.tp_size, group=ctx.world_group)
    return x


def min_over_ranks(values: list[int], ctx: ParallelContext) -> list[int]:
    """Each position's smallest value over all of the model's ranks: sizes that the ranks'
    schedulers must agree on (every rank passes as many values)."""
    if ctx.world_size == 1:
        return values
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=ctx.world_cpu_group)
    least: list[int] = t.tolist()
    return least


def barrier(ctx: ParallelContext) -> None:
    if ctx.world_size > 1:
        dist.barrier(group=ctx.world_cpu_group)


def destroy(ctx: ParallelContext) -> None:
    if ctx.world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()
