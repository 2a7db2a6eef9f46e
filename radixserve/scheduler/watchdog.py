"""The scheduler's watchdog: a forward step stuck longer than --watchdog-timeout stops the process.

A hung step (a deadlocked kernel, a runaway grammar) would otherwise leave every client waiting
forever. The watchdog thread dumps every thread's stack and the batch state to stderr and exits the
scheduler process with a non-zero code; the server notices the dead child and exits too.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixserve.scheduler.scheduler import Scheduler

logger = logging.getLogger("radixserve.scheduler")

# The exit code of a scheduler stopped by its watchdog.
WATCHDOG_EXIT_CODE = 3


def start_watchdog(scheduler: Scheduler, timeout_s: float) -> threading.Thread:
    def watch() -> None:
        while True:
            time.sleep(min(1.0, timeout_s / 4))
            started = scheduler.step_started
            if started is not None and time.monotonic() - started > timeout_s:
                logger.error(
                    "watchdog: a forward step has run for more than %.1fs (--watchdog-timeout); "
                    "running requests: %d, waiting: %d, chunked prefill: %s. Stacks follow.",
                    timeout_s,
                    len(scheduler.queues.running),
                    len(scheduler.queues.waiting),
                    scheduler.queues.chunked_req.rid if scheduler.queues.chunked_req else None,
                )
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                sys.stderr.flush()
                os._exit(WATCHDOG_EXIT_CODE)

    thread = threading.Thread(target=watch, name="radixserve-watchdog", daemon=True)
    thread.start()
    return thread
