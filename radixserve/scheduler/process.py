"""The scheduler process: loads the model, reports ready, then runs the event loop on IPC sockets.

The scheduler runs in the main thread of its own process. Besides isolating the model from the
caller, this matters for speed: torch's OpenMP kernels ran ~1.7x slower from a secondary thread
than from a process's main thread on the development CPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback
from typing import Any

import zmq

from radixserve.args import ServerArgs
from radixserve.ipc import Channel
from radixserve.log import configure_logging
from radixserve.messages import SchedulerFailed, SchedulerInput, SchedulerOutput, SchedulerReady

logger = logging.getLogger("radixserve.scheduler")

# While idle, wake up this often to notice that the parent process has gone away.
PARENT_CHECK_MS = 500


def run_scheduler_process(
    server_args: dict[str, Any], inbox_address: str, outbox_address: str, parent_pid: int
) -> None:
    args = ServerArgs(**server_args)
    configure_logging(args.log_level, prefix=" scheduler")
    context: zmq.Context[Any] = zmq.Context()
    inbox = Channel(context, inbox_address, send=False, bind=False)
    outbox = Channel(context, outbox_address, send=True, bind=False, linger_ms=2000)
    try:
        from radixserve.scheduler.scheduler import Scheduler

        scheduler = Scheduler(args)
        outbox.send(
            SchedulerReady(scheduler.max_total_tokens, scheduler.context_len, scheduler.config.vocab_size)
        )

        def receive(block: bool) -> list[SchedulerInput]:
            messages: list[SchedulerInput] = []
            while block and not messages:
                first = inbox.recv(PARENT_CHECK_MS)
                if first is not None:
                    messages.append(first)
                elif os.getppid() != parent_pid:
                    logger.warning("parent process is gone; scheduler exiting")
                    sys.exit(0)
            while (msg := inbox.recv(0)) is not None:
                messages.append(msg)
            return messages

        def emit(outputs: list[SchedulerOutput]) -> None:
            for out in outputs:
                outbox.send(out)

        scheduler.event_loop(receive, emit)
    except BaseException as exc:
        if not isinstance(exc, SystemExit):
            outbox.send(SchedulerFailed("".join(traceback.format_exception(exc))))
            raise
    finally:
        inbox.close()
        outbox.close()
        context.term()


def main() -> None:
    parser = argparse.ArgumentParser(description="radixserve scheduler process (started by the engine)")
    parser.add_argument("--server-args-json", required=True)
    parser.add_argument("--inbox", required=True)
    parser.add_argument("--outbox", required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    ns = parser.parse_args()
    run_scheduler_process(json.loads(ns.server_args_json), ns.inbox, ns.outbox, ns.parent_pid)


if __name__ == "__main__":
    main()
