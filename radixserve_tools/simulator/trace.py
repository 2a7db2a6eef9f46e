"""Request traces for the simulator: synthetic (Poisson arrivals, length ranges, shared-prefix
groups, multi-turn conversations) or recorded (JSON lines, as `serve --record-trace` would write
them: arrival_s, input_ids or input_len, output_len, and received_s or received_busy_s where the
server recorded them)."""

from __future__ import annotations

import bisect
import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from radixserve_tools.simulator.executor import SIM_VOCAB


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    input_ids: list[int]
    output_len: int
    # When the recorded server's scheduler, idle, took the request (runtime/trace_recorder.py):
    # the simulated scheduler sees it then too. None: not recorded, or taken by a busy scheduler.
    received_s: float | None = None
    # When the recorded server's scheduler, busy, took the request (between two steps).
    received_busy_s: float | None = None


def ready_times(trace: list[TraceRequest]) -> list[float]:
    """When the simulated scheduler may first take each request of `trace`:
    - one the recorded scheduler took while idle: at that moment (every request of one idle
      receipt has the same), so that the simulation's first batches are the server's;
    - one it took while busy but which had arrived before an idle receipt in between: just after
      that receipt. It had not reached the scheduler by then (the engine had stamped its arrival,
      but it was still on its way), and a simulation that took it at once would batch it with
      requests the server ran without it;
    - any other: at its arrival."""
    idle = sorted({r.received_s for r in trace if r.received_s is not None})
    out = []
    for r in trace:
        if r.received_s is not None:
            out.append(r.received_s)
            continue
        ready = r.arrival_s
        if r.received_busy_s is not None:
            missed = bisect.bisect_right(idle, r.received_busy_s) - 1
            if missed >= 0 and idle[missed] >= r.arrival_s:
                ready = math.nextafter(idle[missed], math.inf)
        out.append(ready)
    return out


def pack_traces(traces: Sequence[list[TraceRequest]]) -> dict[str, Any]:
    """Traces as JSON, each distinct prompt written once: the runs of one workload repeat the same
    prompts, and a validation keeps dozens of its runs (unpack_traces reads them back)."""
    prompts: dict[tuple[int, ...], int] = {}

    def row(r: TraceRequest) -> list[Any]:
        index = prompts.setdefault(tuple(r.input_ids), len(prompts))
        return [index, r.arrival_s, r.output_len, r.received_s, r.received_busy_s]

    runs = [[row(r) for r in trace] for trace in traces]
    return {"prompts": [list(p) for p in prompts], "traces": runs}


def unpack_traces(packed: dict[str, Any]) -> list[list[TraceRequest]]:
    prompts = packed["prompts"]
    return [
        [TraceRequest(arrival, list(prompts[index]), output_len, received, busy)
         for index, arrival, output_len, received, busy in trace]
        for trace in packed["traces"]
    ]  # fmt: skip


@dataclass(frozen=True)
class SyntheticTrace:
    num_requests: int = 1000
    request_rate: float = float("inf")  # requests per second (Poisson); inf: all at t=0
    input_len: tuple[int, int] = (512, 512)  # uniform in [lo, hi]
    output_len: tuple[int, int] = (128, 128)
    # Requests fall into this many groups sharing a prefix of prefix_len tokens (0: none).
    prefix_groups: int = 0
    prefix_len: int = 0
    # Conversations of this many turns: each turn's prompt is the last turn's prompt, its reply
    # and a new message of input_len tokens; turns of a conversation arrive turn_gap_s apart.
    turns: int = 1
    turn_gap_s: float = 10.0
    seed: int = 0


def _ids(rng: np.random.Generator, n: int) -> list[int]:
    # Id 0 is what the simulated model outputs; prompts use the others. numpy draws them: 10,000
    # prompts of 512 tokens are five million draws.
    ids: list[int] = rng.integers(1, SIM_VOCAB, n).tolist()
    return ids


def synthetic(spec: SyntheticTrace) -> list[TraceRequest]:
    rng = random.Random(spec.seed)
    id_rng = np.random.default_rng(spec.seed)
    prefixes = [_ids(id_rng, spec.prefix_len) for _ in range(spec.prefix_groups)]
    out: list[TraceRequest] = []
    t = 0.0
    conversations = -(-spec.num_requests // spec.turns)
    for c in range(conversations):
        if spec.request_rate != float("inf"):
            t += rng.expovariate(spec.request_rate / spec.turns)
        history = list(prefixes[c % len(prefixes)]) if prefixes else []
        for turn in range(spec.turns):
            if len(out) == spec.num_requests:
                break
            prompt = history + _ids(id_rng, rng.randint(*spec.input_len))
            output_len = rng.randint(*spec.output_len)
            out.append(TraceRequest(t + turn * spec.turn_gap_s, prompt, output_len))
            history = prompt + [0] * output_len  # the reply the simulated model gives
    return sorted(out, key=lambda r: r.arrival_s)


def load_trace(path: Path, seed: int = 0) -> list[TraceRequest]:
    """A recorded trace: one JSON object per line; input_len draws fresh ids (no prefix sharing)."""
    return load_trace_lines(path.read_text().splitlines(), seed, str(path))


def load_trace_lines(lines: list[str], seed: int = 0, source: str = "trace") -> list[TraceRequest]:
    """load_trace's parsing, of lines already read (e.g. the tail of a file still being written)."""
    rng = np.random.default_rng(seed)
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        row = json.loads(line)
        try:
            ids = (
                [int(t) % SIM_VOCAB for t in row["input_ids"]]
                if "input_ids" in row
                else _ids(rng, int(row["input_len"]))
            )
            arrival = float(row["arrival_s"])
            # Never before the arrival: the two come from different processes' reads of one clock.
            idle, busy = (
                None if row.get(key) is None else max(arrival, float(row[key]))
                for key in ("received_s", "received_busy_s")
            )
            out.append(TraceRequest(arrival, ids, int(row["output_len"]), idle, busy))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"{source}:{number}: a trace line needs arrival_s, input_ids or input_len, output_len"
            ) from exc
    return sorted(out, key=lambda r: r.arrival_s)
