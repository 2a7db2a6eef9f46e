"""The scheduler process: loads the model, reports ready, then runs the event loop on IPC sockets.

The scheduler runs in the main thread of its own process. Besides isolating the model from the
caller, this matters for speed: torch's OpenMP kernels ran markedly slower from a secondary thread
than from a process's main thread (docs/architecture.md).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import TYPE_CHECKING, Any

from radixserve.config.log import configure_logging
from radixserve.config.server_args import ServerArgs
from radixserve.protocol.ipc import ChildArgs, child_channels, exit_after_clean_stop, parse_child_args
from radixserve.protocol.messages import (
    OutputBatch,
    ReqOutput,
    SchedulerInput,
    SchedulerOutput,
    SchedulerReady,
    ShutdownRequest,
)
from radixserve.scheduler.watchdog import start_watchdog

if TYPE_CHECKING:
    from radixserve.distributed.parallel import ParallelContext
    from radixserve.executor.model_runner import ModelRunner
    from radixserve.scheduler.scheduler import Scheduler

logger = logging.getLogger("radixserve.scheduler")


def build_scheduler(
    args: ServerArgs, tokenizer: Any = None, parallel: ParallelContext | None = None, dp_rank: int = 0
) -> Scheduler:
    """A scheduler over a real model: the composition root, where ServerArgs becomes the model
    runner's RunnerConfig. (Tests drive Scheduler with a fake executor instead.)"""
    from radixserve.distributed.parallel import SINGLE
    from radixserve.executor.model_runner import ModelRunner
    from radixserve.executor.runner_config import RunnerConfig
    from radixserve.scheduler.scheduler import Scheduler

    parallel = parallel or SINGLE
    runner = ModelRunner(RunnerConfig.from_server_args(args), parallel=parallel)
    draft = None
    if args.speculative_algorithm == "STANDALONE":
        draft = build_draft_runner(args, runner, parallel)
    return Scheduler(args, runner, tokenizer=tokenizer, parallel=parallel, draft=draft, dp_rank=dp_rank)


def build_draft_runner(args: ServerArgs, target: ModelRunner, parallel: ParallelContext) -> ModelRunner:
    """The STANDALONE draft model: the target's device, dtype and kernels, a KV pool of exactly
    the target's slots (the scheduler's slots index both pools), and the target's context."""
    import dataclasses

    from radixserve.config.server_args import InvalidArgumentError
    from radixserve.executor.model_runner import ModelRunner
    from radixserve.executor.runner_config import RunnerConfig

    config = dataclasses.replace(
        RunnerConfig.from_server_args(args),
        model_path=args.speculative_draft_model_path,
        dtype=str(target.dtype).removeprefix("torch."),
        context_length=None,
        is_embedding=False,
        max_total_tokens=target.max_total_tokens,
        # A draft decode step follows a catch-up that rewrites positions; nothing to keep between.
        decode_staging_tokens=0,
    )
    try:
        draft = ModelRunner(config, parallel=parallel)
    except InvalidArgumentError as error:
        raise InvalidArgumentError(f"--speculative-draft-model-path: {error}") from error
    problems = []
    if draft.config.is_encoder:
        problems.append("it is an encoder, not a causal language model")
    if draft.context_len < target.context_len:
        problems.append(
            f"it handles {draft.context_len} positions and the served context is {target.context_len} "
            "(lower --context-length)"
        )
    if draft.config.vocab_size < target.config.vocab_size:
        problems.append(
            f"its vocabulary ({draft.config.vocab_size}) is smaller than the target's "
            f"({target.config.vocab_size}); it needs the same tokenizer"
        )
    if problems:
        raise InvalidArgumentError(
            f"the draft model {draft.source.path} cannot draft here: {'; '.join(problems)}"
        )
    logger.info("speculative draft model: %s (%s)", draft.source.path, draft.describe()["decode_path"])
    return draft


def place_rank(args: ServerArgs, dp_rank: int, rank: int) -> None:
    """Each rank on this machine gets a GPU of its own, or on a CPU its share of the cores (ranks
    competing for every core run slower than each on its own share)."""
    import torch

    per_node = args.ranks_per_node
    local_ranks = args.dp_size * per_node
    if local_ranks == 1:
        return
    if args.device in ("auto", "cuda") and torch.cuda.is_available():
        args.device = f"cuda:{(dp_rank * per_node + rank % per_node) % torch.cuda.device_count()}"
    elif args.device in ("auto", "cpu"):
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_ranks))


def scheduler_name(args: ServerArgs, dp_rank: int, rank: int) -> str:
    parts = [f"dp{dp_rank}"] if args.dp_size > 1 else []
    parts += [f"pp{rank // args.tp_size}"] if args.pp_size > 1 else []
    parts += [f"tp{rank % args.tp_size}"] if args.tp_size > 1 else []
    return "-".join(["scheduler", *parts])


def run_scheduler_process(server_args: dict[str, Any], child: ChildArgs) -> None:
    """Outputs go to the detokenizer (outbox), which passes on what is not token ids. A
    tensor-parallel rank > 0 has no inbox and sends nothing but its last word if it fails."""
    args = ServerArgs(**server_args)
    dp_rank, rank = int(child.ns.dp_rank), int(child.ns.rank)
    name = scheduler_name(args, dp_rank, rank)
    configure_logging(args.log_level, prefix=f" {name}")
    with child_channels(name, child.inbox, child.outbox, bind_inbox=False) as (inbox, outbox):
        place_rank(args, dp_rank, rank)
        from radixserve.distributed.parallel import barrier, destroy, init_model_parallel
        from radixserve.executor.model_runner import pick_device
        from radixserve.scheduler.event_loop import run_event_loop

        device = pick_device(args.device)
        parallel = init_model_parallel(
            rank, args.tp_size, args.pp_size, child.ns.dist_init_addr or "", device
        )
        # The tokenizer's directory: the scheduler loads it only if a stop string or grammar needs it.
        scheduler = build_scheduler(args, tokenizer=child.tokenizer_dir, parallel=parallel, dp_rank=dp_rank)
        # Ready only when every rank has its weights: the first broadcast would wait for them anyway.
        barrier(parallel)
        if inbox is not None:
            outbox.send(
                SchedulerReady(
                    scheduler.max_total_tokens,
                    scheduler.context_len,
                    scheduler.config.vocab_size,
                    scheduler.is_embedding,
                    scheduler.config.hidden_size,
                )
            )
        if args.watchdog_timeout is not None:
            start_watchdog(scheduler, args.watchdog_timeout)

        def check_parent() -> None:
            # Checked on every step, busy or not: an orphaned scheduler must not keep computing.
            if os.getppid() != child.parent_pid:
                logger.warning("parent process is gone; scheduler exiting")
                sys.exit(0)

        def receive_own(block: bool) -> list[SchedulerInput]:
            assert inbox is not None
            messages: list[SchedulerInput] = []
            while True:
                check_parent()
                if not block or messages:
                    break
                if (first := inbox.recv(child.idle_wait_ms)) is not None:
                    messages.append(first)
                elif args.model_ranks > 1:
                    break  # an empty share now and then keeps the other ranks' collective alive
                elif scheduler.kv_events_pending:
                    break  # the storage tier's I/O thread recorded events while idle: a step publishes them
            while (msg := inbox.recv(0)) is not None:
                messages.append(msg)
            return messages

        def receive(block: bool) -> list[SchedulerInput]:
            if inbox is None:
                check_parent()
                return scheduler.rank_sync.share_messages([])
            return scheduler.rank_sync.share_messages(receive_own(block))

        def emit(outputs: list[SchedulerOutput]) -> None:
            if inbox is None:
                return  # rank 0 answers for the group
            # One message per step for all token outputs; control results keep their place after them.
            tokens = [out for out in outputs if isinstance(out, ReqOutput)]
            if tokens:
                outbox.send(OutputBatch(tokens))
            for out in outputs:
                if not isinstance(out, ReqOutput):
                    outbox.send(out)

        run_event_loop(scheduler, receive, emit)
        if inbox is not None:
            outbox.send(ShutdownRequest())
        destroy(parallel)


def main() -> None:
    child = parse_child_args(
        "radixserve scheduler process (started by the engine)",
        lambda parser: (
            parser.add_argument("--server-args-json", required=True),
            parser.add_argument("--dp-rank", type=int, default=0),
            # This rank among the replica's tp_size x pp_size (parallel.py's ParallelContext.rank).
            parser.add_argument("--rank", type=int, default=0),
            parser.add_argument("--dist-init-addr", default=None),
        ),
    )
    run_scheduler_process(json.loads(child.ns.server_args_json), child)
    exit_after_clean_stop()


if __name__ == "__main__":
    main()
