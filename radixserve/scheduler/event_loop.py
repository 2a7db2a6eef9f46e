"""The scheduler's event loop: receive → handle → step → emit, until a ShutdownRequest.

The loop is apart from Scheduler so that the scheduler can be driven alone, step by step (the
simulator and the tests do), and the process around it (process.py) supplies the transport.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from radixserve.protocol.messages import SchedulerInput, SchedulerOutput, ShutdownRequest
from radixserve.scheduler.scheduler import Scheduler


def run_event_loop(
    scheduler: Scheduler,
    receive: Callable[[bool], list[SchedulerInput]],
    emit: Callable[[list[SchedulerOutput]], None],
) -> None:
    """`receive(block)` returns the messages that arrived; it may wait only when block is True,
    which happens when the scheduler has nothing else to do."""
    while True:
        outputs: list[SchedulerOutput] = []
        idle = scheduler.is_idle
        messages = receive(idle)
        # An idle scheduler wakes on the first request and takes every one waiting by then, at
        # once, however long handling them takes; a busy one takes requests between its steps.
        # The request trace records which, and when, so that a simulation forms the same batches
        # (simulator/simulate.py).
        if messages:  # read only by the requests among them
            scheduler.received_at, scheduler.received_idle = time.monotonic(), idle
        for msg in messages:
            if isinstance(msg, ShutdownRequest):
                scheduler.shutdown()
                return
            outputs += scheduler.handle(msg)
        outputs += scheduler.step()
        if outputs:
            emit(outputs)
