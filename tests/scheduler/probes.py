"""Probes of the scheduler's batch choices, for tests that check what each choice found and left
behind (new_token_ratio, the running and waiting requests, retractions)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from radixserve.scheduler.request import Req
from radixserve.scheduler.scheduler import Scheduler


class ReqView(NamedTuple):
    """A request as it was at one moment (Req objects change as the scheduler runs)."""

    rid: str
    outputs: int
    prompt_len: int
    max_new_tokens: int

    @classmethod
    def of(cls, req: Req) -> ReqView:
        max_new = req.sampling_params.max_new_tokens
        return cls(req.rid, len(req.output_ids), len(req.origin_input_ids), max_new)


@dataclass(frozen=True)
class StepProbe:
    """What one choice of the next batch (Scheduler._next_batch) found and left behind."""

    kind: str  # "prefill", "decode" or "none"
    ratio_before: float
    ratio_after: float
    running_before: list[ReqView]
    running_after: list[ReqView]
    waiting_after: list[ReqView]
    retracted: int  # requests sent back to the queue


def probe_steps(scheduler: Scheduler) -> list[StepProbe]:
    """Records every batch choice the scheduler makes from now on, into the list returned."""
    probes: list[StepProbe] = []
    choose = scheduler._next_batch

    def probed() -> Any:
        ratio, retracted = scheduler.decode.new_token_ratio, scheduler.stats.retracted_reqs
        running = [ReqView.of(r) for r in scheduler.queues.running]
        batch = choose()
        kind = "none" if batch is None else "prefill" if batch.is_prefill else "decode"
        probes.append(
            StepProbe(
                kind,
                ratio,
                scheduler.decode.new_token_ratio,
                running,
                [ReqView.of(r) for r in scheduler.queues.running],
                [ReqView.of(r) for r in scheduler.queues.waiting],
                scheduler.stats.retracted_reqs - retracted,
            )
        )
        return batch

    # An instance attribute shadows the method: step() calls this one.
    scheduler._next_batch = probed  # type: ignore[method-assign]
    return probes
