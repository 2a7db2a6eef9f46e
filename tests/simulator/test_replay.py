"""A trace replayed on the real model on the wall clock (simulator/replay.py): the simulator's own
drive, so a replay forms the batches a simulation of the same trace forms, every forward is
recorded with its measured time, and arrivals wait for their time."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from pathlib import Path

import pytest

from radixserve.config.server_args import ServerArgs
from radixserve.models.config import ModelConfig
from radixserve.models.source import load_model_config, resolve_model_source
from radixserve_tools.simulator.cost_model import ForwardShape, ModelShape, forward_seconds
from radixserve_tools.simulator.executor import ForwardRecord
from radixserve_tools.simulator.hardware import BUILTIN_PROFILES
from radixserve_tools.simulator.replay import (
    compare_forwards,
    decode_host_time,
    forward_kind,
    measured_step_seconds,
    replay,
)
from radixserve_tools.simulator.simulate import simulate
from radixserve_tools.simulator.trace import TraceRequest
from tests.simulator.test_cost_model import LLAMA_8B

SHARED = list(range(1, 41))


def _trace(late_s: float = 0.0) -> list[TraceRequest]:
    """Three requests sharing a 40-token prefix, two of other prompts, and with late_s one more
    that arrives then."""
    trace = [TraceRequest(0.0, SHARED + [50 + i] * (3 + i), 4 + i) for i in range(3)]
    trace += [TraceRequest(0.0, [60 + i] * (20 + 7 * i), 6) for i in range(2)]
    if late_s:
        trace.append(TraceRequest(late_s, SHARED + [90] * 5, 3))
    return trace


def test_a_replay_forms_the_simulations_batches_and_times_each(
    tiny_model_dir: Callable[[str], Path],
) -> None:
    model = str(tiny_model_dir("llama"))
    args = ServerArgs(model_path=model, dtype="float32", max_total_tokens=2048, log_level="warning")
    trace = _trace()
    replayed = replay(args, trace)  # ends with the scheduler's KV check, as a simulation does
    config = load_model_config(resolve_model_source(model))
    simulated = simulate(config, BUILTIN_PROFILES["H100"], trace, 2048)
    assert replayed.requests == simulated.requests == len(trace)
    assert replayed.output_tokens == simulated.output_tokens == sum(r.output_len for r in trace)
    # The warm-up's forwards are not among the records, and its cache was flushed: the same
    # forwards, of the same shapes (their cached prefixes too).
    assert [(r.mode, r.shape) for r in replayed.records] == [(r.mode, r.shape) for r in simulated.records]
    assert replayed.cache_hit_rate == simulated.cache_hit_rate
    assert all(r.seconds > 0 for r in replayed.records)
    records = replayed.records
    assert all(a.start + a.seconds <= b.start for a, b in itertools.pairwise(records))
    assert replayed.makespan_s >= sum(r.seconds for r in replayed.records)
    assert len(replayed.ttft_values_ms) == len(trace)


def test_a_replay_waits_for_each_arrival(tiny_model_dir: Callable[[str], Path]) -> None:
    args = ServerArgs(
        model_path=str(tiny_model_dir("llama")), dtype="float32", max_total_tokens=2048, log_level="warning"
    )
    late = 0.3
    replayed = replay(args, _trace(late_s=late))
    assert replayed.requests == 6
    # The late request's prefill (its 5 new tokens over the cached 40-token prefix) starts no
    # sooner than its arrival, whatever the five before were doing by then.
    prefill = [r for r in replayed.records if r.mode == "EXTEND" and (5, 40) in zip(*_rows(r), strict=True)]
    assert len(prefill) == 1 and prefill[0].start >= late
    last = replayed.records[-1]
    assert last.start + last.seconds <= replayed.makespan_s


def _rows(record: ForwardRecord) -> tuple[list[int], list[int]]:
    return record.shape.q_lens, record.shape.prefix_lens


def test_forwards_are_grouped_by_kind_and_set_against_their_predictions() -> None:
    def record(mode: str, rows: int, prefix: int, idle_s: float = 0.0) -> ForwardRecord:
        shape = ForwardShape([1 if mode == "DECODE" else 16] * rows, [prefix] * rows, rows, mode == "DECODE")
        return ForwardRecord(0.0, 0.0, mode, shape, idle_s)

    kinds = [forward_kind(record("DECODE", n, 100)) for n in (1, 2, 4, 5, 9, 16, 17, 300)]
    assert kinds == [f"decode, batch {b}" for b in ("1", "2-4", "2-4", "5-8", "9-16", "9-16", "17+", "17+")]
    assert forward_kind(record("EXTEND", 2, 0)) == "prefill"
    assert forward_kind(record("EXTEND", 1, 512, idle_s=0.5)) == "extend over a cached prefix, after idle"
    # Measured at exactly the prediction, and at twice it: each kind's sums and error.
    config = ModelConfig.from_hf_dict(LLAMA_8B)
    profile = BUILTIN_PROFILES["H100"]
    model = ModelShape.of(config)
    # Two extends over a prefix, e^0.1 and e^-0.1 times their predictions: their logs spread by 0.1414.
    records = [record("DECODE", 4, 100), record("EXTEND", 2, 0), record("EXTEND", 2, 0)]
    records += [record("EXTEND", 1, 512), record("EXTEND", 1, 512)]
    predicted = [forward_seconds(model, profile, r.shape) for r in records]
    factors = [1, 2, 2, math.exp(0.1), math.exp(-0.1)]
    timed = zip(records, predicted, factors, strict=True)
    records = [dataclasses.replace(r, seconds=p * f) for r, p, f in timed]
    groups = {g.kind: g for g in compare_forwards(records, config, profile)}
    assert groups["decode, batch 2-4"].count == 1 and groups["decode, batch 2-4"].error == pytest.approx(0.0)
    assert groups["decode, batch 2-4"].spread == 0.0
    assert groups["prefill"].count == 2 and groups["prefill"].error == pytest.approx(-0.5)
    assert groups["prefill"].predicted_s == pytest.approx(predicted[1] + predicted[2])
    assert groups["prefill"].spread == pytest.approx(0.0, abs=1e-12)
    assert groups["extend over a cached prefix"].spread == pytest.approx(math.sqrt(0.02))


def test_the_schedulers_time_between_two_forwards_counts_with_the_second() -> None:
    """A calibration run times the scheduler's host work between forwards along with them, so a
    replayed forward right after another is measured with its gap; after an idle spell, alone."""
    config = ModelConfig.from_hf_dict(LLAMA_8B)
    profile = BUILTIN_PROFILES["H100"]
    shape = ForwardShape([1, 1], [100, 100], 2, decode=True)
    predicted = forward_seconds(ModelShape.of(config), profile, shape)
    back_to_back = ForwardRecord(0.0, predicted, "DECODE", shape, idle_s=0.004)
    after_idle = ForwardRecord(0.0, predicted, "DECODE", shape, idle_s=0.5)
    assert measured_step_seconds(back_to_back) == pytest.approx(predicted + 0.004)
    assert measured_step_seconds(after_idle) == predicted
    (group,) = compare_forwards([back_to_back], config, profile)
    assert group.measured_s == pytest.approx(predicted + 0.004)
    assert group.error == pytest.approx(predicted / (predicted + 0.004) - 1)


def test_the_schedulers_time_between_decode_steps_is_a_line_in_their_rows() -> None:
    """decode_host_time draws the scheduler's time before each back-to-back decode step as a
    fixed part plus a part per row; prefills and steps after an idle spell are left out."""

    def step(rows: int, idle_s: float, mode: str = "DECODE") -> ForwardRecord:
        shape = ForwardShape([1] * rows, [100] * rows, rows, decode=mode == "DECODE")
        return ForwardRecord(0.0, 0.02, mode, shape, idle_s)

    records = [step(rows, 0.5e-3 + 80e-6 * rows) for rows in (1, 2, 2, 4, 8)]
    records += [step(3, 0.5, "DECODE"), step(4, 5e-3, "EXTEND")]  # after idle; a prefill
    host = decode_host_time(records)
    assert host is not None and host.steps == 5
    assert host.fixed_s == pytest.approx(0.5e-3) and host.per_row_s == pytest.approx(80e-6)
    assert "80 us per row" in host.describe(BUILTIN_PROFILES["H100"])
    assert decode_host_time([step(2, 1e-3), step(2, 2e-3)]) is None  # one batch size: no line
