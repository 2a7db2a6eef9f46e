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
import signal
import sys
import traceback
from typing import Any

import zmq

from radixserve.args import ServerArgs
from radixserve.ipc import Channel
from radixserve.log import configure_logging
from radixserve.messages import (
    OutputBatch,
    ReqOutput,
    SchedulerFailed,
    SchedulerInput,
    SchedulerOutput,
    SchedulerReady,
    ShutdownRequest,
)

logger = logging.getLogger("radixserve.scheduler")

# While idle, wake up this often to notice that the parent process has gone away.
PARENT_CHECK_MS = 500


def run_scheduler_process(
    server_args: dict[str, Any], tokenizer_dir: str, inbox_address: str, outbox_address: str, parent_pid: int
) -> None:
    """Outputs go to the detokenizer (outbox), which passes on what is not token ids."""
    # Ctrl-C reaches the whole process group; the parent decides when children stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    args = ServerArgs(**server_args)
    configure_logging(args.log_level, prefix=" scheduler")
    context: zmq.Context[Any] = zmq.Context()
    inbox = Channel(context, inbox_address, send=False, bind=False)
    outbox = Channel(context, outbox_address, send=True, bind=False, linger_ms=2000)
    try:
        from transformers import AutoTokenizer

        from radixserve.scheduler.scheduler import Scheduler

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
        scheduler = Scheduler(args, tokenizer=tokenizer)
        outbox.send(
            SchedulerReady(scheduler.max_total_tokens, scheduler.context_len, scheduler.config.vocab_size)
        )

        def receive(block: bool) -> list[SchedulerInput]:
            messages: list[SchedulerInput] = []
            while True:
                # Checked on every step, busy or not: an orphaned scheduler must not keep computing.
                if os.getppid() != parent_pid:
                    logger.warning("parent process is gone; scheduler exiting")
                    sys.exit(0)
                if not block or messages:
                    break
                if (first := inbox.recv(PARENT_CHECK_MS)) is not None:
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
    parser.add_argument("--tokenizer-dir", required=True)
    parser.add_argument("--inbox", required=True)
    parser.add_argument("--outbox", required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    ns = parser.parse_args()
    run_scheduler_process(
        json.loads(ns.server_args_json), ns.tokenizer_dir, ns.inbox, ns.outbox, ns.parent_pid
    )


if __name__ == "__main__":
    main()
