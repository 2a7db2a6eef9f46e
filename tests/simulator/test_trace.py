"""Recorded and synthetic traces (simulator/trace.py)."""

from __future__ import annotations

import json

from radixserve_tools.simulator.trace import (
    SyntheticTrace,
    TraceRequest,
    pack_traces,
    synthetic,
    unpack_traces,
)


def test_packed_traces_read_back_equal_and_write_each_prompt_once() -> None:
    spec = SyntheticTrace(num_requests=6, input_len=(20, 40), prefix_groups=2, prefix_len=16, seed=3)
    shared = synthetic(spec)
    # A second run of the same prompts, recorded with other times, and a run of other prompts.
    again = [
        TraceRequest(r.arrival_s + 0.25, r.input_ids, r.output_len, received_s=r.arrival_s + 0.3)
        for r in shared
    ]
    other = [TraceRequest(0.0, [7, 8, 9], 4, received_busy_s=0.01)]
    traces = [shared, again, other]
    packed = json.loads(json.dumps(pack_traces(traces)))
    assert unpack_traces(packed) == traces
    assert len(packed["prompts"]) == len({tuple(r.input_ids) for r in shared}) + 1
