"""The scheduler process: loads the model, reports ready, then runs the event loop on IPC sockets.

The scheduler runs in the main thread of its own process. Besides isolating the model from the
caller, this matters for speed: torch's OpenMP kernels ran ~1.7x slower from a secondary thread
than from a process's main thread on the development CPU.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

from radixserve.args import ServerArgs
from radixserve.ipc import ChildArgs, child_channels, parse_child_args
from radixserve.log import configure_logging
from radixserve.messages import (
    OutputBatch,
    ReqOutput,
    SchedulerInput,
    SchedulerOutput,
    SchedulerReady,
    ShutdownRequest,
)
from radixserve.scheduler.watchdog import start_watchdog

logger = logging.getLogger("radixserve.scheduler")


def place_replica(args: ServerArgs, rank: int) -> None:
    """A data-parallel replica gets a GPU of its own, or on a CPU its share of the cores (replicas
    competing for every core run slower than each on its own share)."""
    import torch

    if args.device in ("auto", "cuda") and torch.cuda.is_available():
        args.device = f"cuda:{rank % torch.cuda.device_count()}"
    elif args.device in ("auto", "cpu"):
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.dp_size))


def run_scheduler_process(server_args: dict[str, Any], child: ChildArgs) -> None:
    """Outputs go to the detokenizer (outbox), which passes on what is not token ids."""
    args = ServerArgs(**server_args)
    rank = int(child.ns.dp_rank)
    name = "scheduler" if args.dp_size == 1 else f"scheduler-dp{rank}"
    configure_logging(args.log_level, prefix=f" {name}")
    with child_channels(name, child.inbox, child.outbox, bind_inbox=False) as (inbox, outbox):
        if args.dp_size > 1:
            place_replica(args, rank)
        from transformers import AutoTokenizer

        from radixserve.scheduler.scheduler import Scheduler

        tokenizer = AutoTokenizer.from_pretrained(child.tokenizer_dir, local_files_only=True)
        scheduler = Scheduler(args, tokenizer=tokenizer)
        outbox.send(
            SchedulerReady(
                scheduler.max_total_tokens,
                scheduler.context_len,
                scheduler.config.vocab_size,
                scheduler.runner.is_embedding,
                scheduler.config.hidden_size,
            )
        )
        if args.watchdog_timeout is not None:
            start_watchdog(scheduler, args.watchdog_timeout)

        def receive(block: bool) -> list[SchedulerInput]:
            messages: list[SchedulerInput] = []
            while True:
                # Checked on every step, busy or not: an orphaned scheduler must not keep computing.
                if os.getppid() != child.parent_pid:
                    logger.warning("parent process is gone; scheduler exiting")
                    sys.exit(0)
                if not block or messages:
                    break
                if (first := inbox.recv(child.idle_wait_ms)) is not None:
                    messages.append(first)
            while (msg := inbox.recv(0)) is not None:
                messages.append(msg)
            return messages

        def emit(outputs: list[SchedulerOutput]) -> None:
            # One message per step for all token outputs; control results keep their place after them.
            tokens = [out for out in outputs if isinstance(out, ReqOutput)]
            if tokens:
                outbox.send(OutputBatch(tokens))
            for out in outputs:
                if not isinstance(out, ReqOutput):
                    outbox.send(out)

        scheduler.event_loop(receive, emit)
        outbox.send(ShutdownRequest())


def main() -> None:
    child = parse_child_args(
        "radixserve scheduler process (started by the engine)",
        lambda parser: (
            parser.add_argument("--server-args-json", required=True),
            parser.add_argument("--dp-rank", type=int, default=0),
        ),
    )
    run_scheduler_process(json.loads(child.ns.server_args_json), child)


if __name__ == "__main__":
    main()
