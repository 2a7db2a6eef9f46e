"""Micro-batches for pipeline parallelism (--pp-size N > 1): every stage busy at once.

With one batch at a time, a pipeline's stages take turns: while the last stage computes, the others
wait for its tokens. Here the scheduler launches a micro-batch every tick, and the executor runs one
tick of every stage at once (Executor.forward_pipeline): stage s runs the micro-batch launched s
ticks ago. Up to N micro-batches are in flight; the one the last stage finishes lands at the end of
the tick, and its tokens are sampled and appended as after any step.

Two facts keep this the same computation as one batch at a time:
- A request is in at most one micro-batch in flight, because its next input is the token that
  batch will sample. A micro-batch's requests leave the scheduler's queues
  (RequestQueues.in_flight) until it lands, so neither the prefill nor the decode side sees them.
- K/V slots need no rule of their own: every stage runs the micro-batches in the order they were
  launched. So whatever K/V a micro-batch reads at a stage (a prefix another request computed, an
  earlier chunk of its prompt) an earlier micro-batch wrote there already; and a slot freed while
  a micro-batch that uses it is in flight goes only to later micro-batches, which at every stage
  run after it.

What follows from the first:
- A decode micro-batch takes a 1/N share of the requests that run (those waiting longest first), so
  they settle into N groups that take turns.
- A prompt prefilled in chunks is the exception: its next chunk needs no token, so it may follow
  while the last is in flight. Each micro-batch records at launch which requests sample
  (ScheduledBatch.samples), since the request has moved on by the time a chunk lands. A prompt
  that wants prompt logprobs or hidden states keeps to one chunk in flight: each chunk's rows are
  noted on the request until it lands.
- Retraction chooses among the requests at rest only. When even those cannot decode, no batch is
  launched until the pipeline drains, so retraction then sees every request, as with one stage.
- Aborts and control messages drain the pipeline first (scheduler.py), so they find every request
  at rest and free nothing a stage may still write.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixserve.forward.batch import ForwardBatch
from radixserve.scheduler.batch import KVContext
from radixserve.scheduler.decode import DecodeManager
from radixserve.scheduler.prefill import PrefillManager
from radixserve.scheduler.request import Req
from radixserve.scheduler.state import RequestQueues, ScheduledBatch


@dataclass
class Flight:
    """A micro-batch going through the stages."""

    batch: ScheduledBatch
    # Those of its requests that were running when it launched: running again when it lands.
    was_running: list[Req]
    # Those it put in RequestQueues.in_flight: all but a request whose prompt it computes a
    # non-final chunk of, which stays the chunked request so that its next chunk may follow.
    parked: list[Req]


class MicroBatchPipeline:
    def __init__(
        self,
        stages: int,
        queues: RequestQueues,
        kv: KVContext,
        prefill: PrefillManager,
        decode: DecodeManager,
    ):
        if stages < 2:
            raise ValueError("a pipeline of micro-batches needs at least two stages")
        self.stages = stages
        self.queues = queues
        self.kv = kv
        self.prefill = prefill
        self.decode = decode
        # Launched in the last stages - 1 ticks, newest first: flights[s] reaches stage s + 1 next.
        self.flights: list[Flight | None] = [None] * (stages - 1)
        self.ticks = 0
        # Over all ticks, the stages that had a micro-batch to run: how busy the pipeline was kept.
        self.busy_stage_ticks = 0

    @property
    def in_flight(self) -> bool:
        return any(f is not None for f in self.flights)

    def next_batch(self) -> ScheduledBatch | None:
        """The micro-batch to launch this tick: a prefill when one can be admitted (and no chunk of
        a prompt is in flight), else a decode share of the requests at rest; None for a bubble."""
        queues = self.queues
        chunked = queues.chunked_req
        if chunked is None or not self.holds(chunked) or self._chunks_may_overlap(chunked):
            prefill = self.prefill.next_batch()
            if prefill is not None:
                return prefill
        if not queues.running:
            return None
        share = -(-(len(queues.running) + len(queues.in_flight)) // self.stages)
        needed = self.kv.slots_needed_for_decode(queues.running[:share])
        if self.in_flight and self.kv.available_with_eviction() < needed:
            return None  # retract once the pipeline has drained, choosing among every request
        return self.decode.next_batch(limit=share)

    def launch(self, batch: ScheduledBatch | None) -> list[ForwardBatch | None]:
        """Puts `batch` (None: nothing) in at the first stage, its requests out of the queues;
        returns what each stage runs this tick."""
        flight = None
        if batch is not None:
            queues = self.queues
            members = {id(r) for r in batch.reqs}
            was_running = [r for r in queues.running if id(r) in members]
            queues.running = [r for r in queues.running if id(r) not in members]
            parked = [r for r in batch.reqs if r is not queues.chunked_req]
            queues.in_flight += parked
            flight = Flight(batch, was_running, parked)
        self.flights.insert(0, flight)
        return [None if f is None else f.batch.forward for f in self.flights]

    def land(self) -> ScheduledBatch | None:
        """Ends the tick: the micro-batch the last stage ran (None if it ran none), with its
        requests back where they were; the scheduler then decides its tokens."""
        self.ticks += 1
        self.busy_stage_ticks += sum(f is not None for f in self.flights)
        flight = self.flights.pop()
        if flight is None:
            return None
        queues = self.queues
        parked = {id(r) for r in flight.parked}
        queues.in_flight = [r for r in queues.in_flight if id(r) not in parked]
        queues.running += flight.was_running
        return flight.batch

    def holds(self, req: Req) -> bool:
        """Whether a micro-batch still in flight (not one that just landed) computes for req."""
        return any(f is not None and any(r is req for r in f.batch.reqs) for f in self.flights)

    @staticmethod
    def _chunks_may_overlap(req: Req) -> bool:
        """Whether req's next chunk may launch while one is in flight: not when each chunk's
        prompt logprobs or hidden states are noted on the request until the chunk lands."""
        return not (req.needs_input_logprobs or req.needs_prompt_hidden_states)

    def stats(self) -> dict[str, Any]:
        """For get_server_info: the stages, ticks run, and the share of stage-ticks with work."""
        possible = self.ticks * self.stages
        return {
            "stages": self.stages,
            "ticks": self.ticks,
            "busy_stage_ticks": self.busy_stage_ticks,
            "utilization": self.busy_stage_ticks / possible if possible else 0.0,
        }
