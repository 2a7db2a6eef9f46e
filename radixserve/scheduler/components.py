"""The scheduler's features as components of its step (scheduler.py walks them in order).

The step's phases are fixed: receive (work that finished outside the queues joins them) → pick a
batch → forward → process its results → end the step; with nothing to run, idle (sleep on what a
component still waits for, else the idle self-check). A feature that acts at some of these phases
is a StepComponent that overrides those hooks; the other hooks do nothing.
"""

from __future__ import annotations

from collections.abc import Callable

from radixserve.cache.tiers import CacheTier
from radixserve.protocol.messages import FinishReason, ReqOutput
from radixserve.scheduler.disaggregation.decode import DecodeHandoffs
from radixserve.scheduler.disaggregation.prefill import PrefillHandoffs
from radixserve.scheduler.grammar_queue import GrammarQueue
from radixserve.scheduler.kv_events import KVEventPublisher
from radixserve.scheduler.profiler import StepProfiler
from radixserve.scheduler.request import Req
from radixserve.scheduler.speculative.worker import Speculator
from radixserve.scheduler.state import RequestQueues, ScheduledBatch
from radixserve.scheduler.stats import SchedulerStats


class StepComponent:
    """One feature's part in the step loop."""

    def receive(self) -> list[ReqOutput]:
        """Start of a step: requests this feature was holding join the queues (or fail)."""
        return []

    @property
    def pending(self) -> bool:
        """Work of this feature's own outside the queues: the scheduler is not idle while it lasts."""
        return False

    def wait(self, timeout_s: float) -> bool:
        """Nothing to run: sleep up to timeout_s on this feature's work, if it has some (True)."""
        return False

    def before_forward(self, batch: ScheduledBatch | None, is_prefill: bool) -> None:
        """A forward is about to run (batch None: a pipeline tick launching nothing)."""

    def after_forward(self, batch: ScheduledBatch | None, is_prefill: bool) -> None:
        """The forward returned (its results not yet decided)."""

    def after_results(self, batch: ScheduledBatch, is_prefill: bool, seconds: float) -> None:
        """A step's results are decided; seconds: its forward and the deciding together."""

    def end_step(self) -> None:
        """End of every step, whether a batch ran or not."""

    def shutdown(self) -> None:
        """The scheduler stops: threads and resources go."""


class GrammarArrivals(StepComponent):
    """Requests with a grammar wait here while it compiles, then join the waiting queue; a grammar
    that fails to compile finishes its request with a 400 (the request's own fault)."""

    def __init__(
        self, queue: GrammarQueue, enqueue: Callable[[Req], None], finish: Callable[[Req], ReqOutput]
    ):
        self.queue, self.enqueue, self.finish = queue, enqueue, finish

    def receive(self) -> list[ReqOutput]:
        if not self.queue.pending:
            return []
        ready, failed = self.queue.poll()
        for req in ready:
            self.enqueue(req)
        outputs = []
        for req, error in failed:
            req.finished_reason = FinishReason("abort", message=error, status_code=400)
            outputs.append(self.finish(req))
        return outputs

    @property
    def pending(self) -> bool:
        return bool(self.queue.pending)

    def wait(self, timeout_s: float) -> bool:
        if not self.queue.pending:
            return False
        self.queue.wait(timeout_s)
        return True

    def shutdown(self) -> None:
        self.queue.shutdown()


class TierLoads(StepComponent):
    """Prefixes loading from the cache tier below the pool: their requests wait in the queue."""

    def __init__(self, tier: CacheTier):
        self.tier = tier

    def wait(self, timeout_s: float) -> bool:
        if not self.tier.loading:
            return False
        self.tier.wait_for_loads(timeout_s)
        return True

    def shutdown(self) -> None:
        self.tier.close()


class HandoffArrivals(StepComponent):
    """Decode side of --disaggregation-mode: requests wait here for their prompt's K/V. Each step
    reserves KV for the waiting ones and claims what came (disaggregation/decode.py); `start`
    runs the requests whose K/V came, `finish` answers those whose transfer failed."""

    def __init__(
        self,
        handoffs: DecodeHandoffs,
        queues: RequestQueues,
        stats: SchedulerStats,
        start: Callable[[list[Req], list[int]], list[ReqOutput]],
        finish: Callable[[Req], ReqOutput],
    ):
        self.handoffs, self.queues, self.stats = handoffs, queues, stats
        self.start, self.finish = start, finish

    def receive(self) -> list[ReqOutput]:
        if not self.handoffs.awaiting:
            return []
        self.handoffs.reserve_and_claim(self.queues.running)
        outputs, came = [], []
        for got in self.handoffs.receive():
            if got.error is None:
                came.append(got)
                continue
            got.req.abort(got.error, got.status_code)
            self.stats.aborted_reqs += 1
            outputs.append(self.finish(got.req))
        return outputs + self.start([got.req for got in came], [got.first_token for got in came])

    @property
    def pending(self) -> bool:
        return bool(self.handoffs.awaiting)

    def wait(self, timeout_s: float) -> bool:
        if not self.handoffs.awaiting:
            return False
        self.handoffs.wait(timeout_s)
        return True

    def shutdown(self) -> None:
        self.handoffs.close()


class PrefillHandoffsClose(StepComponent):
    """Prefill side of --disaggregation-mode: its transfers close with the scheduler (a finished
    request's K/V is handed on where it is published, scheduler.py)."""

    def __init__(self, handoffs: PrefillHandoffs):
        self.handoffs = handoffs

    def shutdown(self) -> None:
        self.handoffs.close()


class KVEventsFlush(StepComponent):
    """--kv-events-config: the step's recorded cache events are published at its end."""

    def __init__(self, publisher: KVEventPublisher):
        self.publisher = publisher

    def end_step(self) -> None:
        self.publisher.flush()

    def shutdown(self) -> None:
        self.publisher.shutdown()


class SpeculatorHooks(StepComponent):
    """--speculative-algorithm: the slots a plain forward writes (the draft's K/V there is stale),
    and what a decode step cost, which drafting weighs itself against."""

    def __init__(self, speculator: Speculator):
        self.speculator = speculator

    def before_forward(self, batch: ScheduledBatch | None, is_prefill: bool) -> None:
        if batch is not None and batch.verify is None:
            self.speculator.written(batch.forward.out_cache_loc)

    def after_results(self, batch: ScheduledBatch, is_prefill: bool, seconds: float) -> None:
        if not is_prefill:
            self.speculator.observe_forward(batch.forward.num_tokens, seconds, plain=batch.verify is None)


class ProfilerHooks(StepComponent):
    """/start_profile: the torch profiler around the forwards it was asked to record."""

    def __init__(self, profiler: StepProfiler):
        self.profiler = profiler

    def before_forward(self, batch: ScheduledBatch | None, is_prefill: bool) -> None:
        self.profiler.before_step(is_prefill)

    def after_forward(self, batch: ScheduledBatch | None, is_prefill: bool) -> None:
        self.profiler.after_step(is_prefill)
