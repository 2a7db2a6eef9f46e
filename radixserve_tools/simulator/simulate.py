"""Driving the real Scheduler over a trace on a virtual clock: requests arrive at their trace times,
each step's forward costs what the cost model says, and every output is stamped with the clock
at the end of the forward that made it. Idle gaps jump to the next request's arrival, or to when
the recorded server's scheduler could take it (trace.ready_times)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from radixserve.config.server_args import ServerArgs, chunked_prefill_tokens
from radixserve.models.config import ModelConfig
from radixserve.protocol.messages import GenerateRequest, ReqOutput
from radixserve.protocol.sampling_params import SamplingParams
from radixserve.runtime.live_stats import percentiles
from radixserve.scheduler.scheduler import Scheduler
from radixserve_tools.simulator.cost_model import ModelShape
from radixserve_tools.simulator.executor import CostModelExecutor, ForwardRecord, VirtualClock
from radixserve_tools.simulator.hardware import HardwareProfile
from radixserve_tools.simulator.trace import TraceRequest, ready_times

# The share of device memory the weights and the KV pool may take (SGLang's mem_fraction_static).
MEM_FRACTION_STATIC = 0.88


def kv_capacity(config: ModelConfig, profile: HardwareProfile) -> int:
    """KV slots that fit beside the weights in the profile's memory."""
    shape = ModelShape.of(config)
    free = profile.memory_bytes * MEM_FRACTION_STATIC - shape.weight_bytes
    if free <= 0:
        raise ValueError(f"the model's weights do not fit in {profile.name}'s memory")
    return int(free // shape.kv_bytes_per_token)


@dataclass
class _Timing:
    arrival: float
    prompt_tokens: int
    first: float | None = None
    last: float | None = None
    end: float | None = None
    gaps: list[float] = field(default_factory=list)
    cached_tokens: int = 0


@dataclass
class _Hits:
    """Prompt and cached tokens of the requests started so far, kept as outputs come (a sum over
    every request after each prefill would cost O(requests) per step)."""

    prompt: int = 0
    cached: int = 0

    @property
    def rate(self) -> float:
        return self.cached / self.prompt if self.prompt else 0.0


@dataclass
class SimResult:
    makespan_s: float
    requests: int
    input_tokens: int
    output_tokens: int
    ttft_ms: dict[str, Any]
    itl_ms: dict[str, Any]
    e2e_ms: dict[str, Any]
    cache_hit_rate: float
    retracted_reqs: int
    max_total_tokens: int
    forwards: int
    wall_s: float
    # (virtual time, KV slots in use, of which evictable cache) after every step.
    kv_timeline: list[tuple[float, int, int]]
    # (virtual time, cumulative cache hit rate) after every prefill.
    hit_timeline: list[tuple[float, float]]
    # Scheduler time per step, measured (seconds of host time, not simulated).
    scheduler_step_s: list[float]
    # Every finished request's TTFT.
    ttft_values_ms: list[float] = field(default_factory=list)
    # Every forward the executor was asked for, with its shape and cost.
    records: list[ForwardRecord] = field(default_factory=list)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.makespan_s if self.makespan_s else 0.0

    @property
    def requests_s(self) -> float:
        return self.requests / self.makespan_s if self.makespan_s else 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "makespan_s": self.makespan_s,
            "requests_per_s": self.requests_s,
            "input_tok_s": self.input_tokens / self.makespan_s if self.makespan_s else 0.0,
            "output_tok_s": self.output_tok_s,
            "ttft_ms": self.ttft_ms,
            "itl_ms": self.itl_ms,
            "e2e_ms": self.e2e_ms,
            "cache_hit_rate": self.cache_hit_rate,
            "retracted_reqs": self.retracted_reqs,
            "max_total_tokens": self.max_total_tokens,
            "forwards": self.forwards,
            "wall_s": self.wall_s,
        }


def simulate(
    config: ModelConfig,
    profile: HardwareProfile | None,
    trace: list[TraceRequest],
    max_total_tokens: int,
    count_shared_reads: bool | None = None,
    seed: int = 0,
    **server_args: Any,
) -> SimResult:
    """Runs the trace; server_args are ServerArgs fields (schedule policy, chunking, limits...);
    count_shared_reads and seed as for CostModelExecutor."""
    clock = VirtualClock()
    executor = CostModelExecutor(
        config, max_total_tokens, profile, clock, count_shared_reads=count_shared_reads, seed=seed
    )
    server_args.setdefault("log_level", "warning")
    if server_args.get("chunked_prefill_size") is None:
        # The scheduler here runs on the CPU whatever device the profile models: the chunk a
        # server takes on that device (no profile: a GPU's).
        device_type = "cuda" if profile is None else profile.device_type
        server_args["chunked_prefill_size"] = chunked_prefill_tokens(None, device_type)
    scheduler = Scheduler(ServerArgs(**server_args), executor)
    return drive(scheduler, executor.records, trace, clock, max_total_tokens)


class Clock(Protocol):
    """The time a drive runs on: the simulator's virtual clock, which forwards advance, or the
    wall clock of a replay on the real model (replay.py)."""

    @property
    def now(self) -> float: ...

    def advance_to(self, t: float) -> None:
        """Lets time pass until t (the scheduler is idle until a request reaches it then)."""


def drive(
    scheduler: Scheduler,
    records: list[ForwardRecord],
    trace: list[TraceRequest],
    clock: Clock,
    max_total_tokens: int,
) -> SimResult:
    """Feeds `trace` to `scheduler` on `clock` as the server's event loop would, and steps it until
    every request has finished; `records` is where its executor records each forward."""
    timings: dict[str, _Timing] = {}
    kv_timeline: list[tuple[float, int, int]] = []
    hit_timeline: list[tuple[float, float]] = []
    step_s: list[float] = []
    hits = _Hits()
    started = time.perf_counter()
    ready = ready_times(trace)
    order = sorted(range(len(trace)), key=lambda i: ready[i])
    pending, ready = [trace[i] for i in order], [ready[i] for i in order]
    next_up = 0
    stalled = 0
    while next_up < len(pending) or not scheduler.is_idle:
        while next_up < len(pending):
            req = pending[next_up]
            # An idle scheduler wakes when the next request reaches it and takes every request
            # that has by then in one go; a busy one takes them between its steps.
            if ready[next_up] > clock.now:
                break
            rid = f"r{next_up}"
            timings[rid] = _Timing(req.arrival_s, len(req.input_ids))
            params = {"max_new_tokens": req.output_len, "ignore_eos": True, "temperature": 0.0}
            accepted = scheduler.handle(
                GenerateRequest(rid, list(req.input_ids), SamplingParams.from_dict(params))
            )
            _take(accepted, timings, clock.now, hits)
            next_up += 1
        if scheduler.is_idle:
            clock.advance_to(ready[next_up])
            continue
        forwards = len(records)
        t0 = time.perf_counter()
        outputs = scheduler.step()
        step_s.append(time.perf_counter() - t0)
        _take(outputs, timings, clock.now, hits)
        stalled = 0 if len(records) > forwards or outputs else stalled + 1
        if stalled > 1000:
            raise RuntimeError("the scheduler made no progress for 1000 steps")
        usage = scheduler.allocator.available_size()
        cached = scheduler.tree_cache.evictable_size()
        kv_timeline.append((clock.now, max_total_tokens - usage, cached))
        if records and records[-1].mode == "EXTEND" and len(records) > forwards:
            hit_timeline.append((clock.now, hits.rate))
    # Idle now: every KV slot is free or evictable, as after any run of the real scheduler.
    scheduler.check_kv_invariant()
    done = [t for t in timings.values() if t.end is not None]
    first_arrival = pending[0].arrival_s if pending else 0.0
    ttfts = [(t.first - t.arrival) * 1000 for t in done if t.first is not None]
    return SimResult(
        makespan_s=clock.now - first_arrival,
        requests=len(done),
        input_tokens=sum(t.prompt_tokens for t in done),
        output_tokens=sum(len(t.gaps) + 1 for t in done if t.first is not None),
        ttft_ms=percentiles(ttfts),
        itl_ms=percentiles([g * 1000 for t in done for g in t.gaps]),
        e2e_ms=percentiles([(t.end - t.arrival) * 1000 for t in done if t.end is not None]),
        cache_hit_rate=hits.rate,
        retracted_reqs=scheduler.stats.retracted_reqs,
        max_total_tokens=max_total_tokens,
        forwards=len(records),
        wall_s=time.perf_counter() - started,
        kv_timeline=kv_timeline,
        hit_timeline=hit_timeline,
        scheduler_step_s=step_s,
        ttft_values_ms=ttfts,
        records=records,
    )


def _take(outputs: list[Any], timings: dict[str, _Timing], now: float, hits: _Hits) -> None:
    for out in outputs:
        if not isinstance(out, ReqOutput):
            continue
        timing = timings[out.rid]
        if timing.first is not None:
            hits.cached += out.cached_tokens - timing.cached_tokens
        timing.cached_tokens = out.cached_tokens
        for _ in out.new_token_ids:
            if timing.first is None:
                timing.first = now
                hits.prompt += timing.prompt_tokens
                hits.cached += timing.cached_tokens
            elif timing.last is not None:
                timing.gaps.append(now - timing.last)
            timing.last = now
        if out.finished_reason is not None:
            timing.end = now
