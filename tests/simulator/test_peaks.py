"""simulator/peaks.py: the peaks calibrate measures are on the matmul the engine's linears run."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from radixserve.config.server_args import ServerArgs
from radixserve.executor.model_runner import ModelRunner
from radixserve.executor.runner_config import RunnerConfig
from radixserve_tools.simulator import peaks
from radixserve_tools.simulator.hardware import HardwareProfile, PointwiseCosts
from radixserve_tools.simulator.peaks import (
    OVERLAP_ROWS,
    engine_attention,
    engine_kernels,
    engine_linears,
    measure_decode_overlap,
    measure_extend_attention,
    measure_flops,
    measure_linear_rates,
    measure_pointwise,
    measure_prompt_attention,
    median_measurements,
    weights_bandwidth,
)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_peak_is_the_matmul_the_engine_runs(tiny_model_dir: Callable[[str], Path], dtype: str) -> None:
    """calibrate's matmul peak times the linear kernel the model runner picks for the same flags:
    torch's bf16 matmul is emulated on a CPU without AVX-512 BF16, a hundred times slower than
    the native kernel the engine runs there."""
    args = ServerArgs(model_path=str(tiny_model_dir("llama")), dtype=dtype, max_total_tokens=256)
    runner = ModelRunner(RunnerConfig.from_server_args(args))
    try:
        chosen = runner.describe()["linear_kernel"]
    finally:
        runner.close()
    device = torch.device("cpu")
    dtype_used, packing = engine_linears(args, device)
    assert dtype_used == runner.dtype
    if dtype == "float32":
        assert packing is None
    else:
        assert packing is not None and packing.kernel == chosen
    assert measure_flops(device, seconds=0.05, dtype=dtype_used, packing=packing) > 0
    rates = measure_linear_rates(device, seconds=0.05, dtype=dtype_used, packing=packing, widths=(64, 128))
    assert [width for width, _ in rates] == [64, 128] and all(rate > 0 for _, rate in rates)
    # The stack of linears by rows, on the same kernel: 64 rows' compute is 64 times one row's.
    overlap = measure_decode_overlap(device, seconds=0.05, dtype=dtype_used, packing=packing)
    assert [rows for rows, _ in overlap] == list(OVERLAP_ROWS)
    assert all(seconds > 0 for _, seconds in overlap) and overlap[-1][1] > overlap[0][1]
    assert weights_bandwidth(overlap, dtype_used) > 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_pointwise_costs_are_timed_on_the_engines_kernels(dtype: str) -> None:
    """The pointwise ops are the engine's own layers, on the native kernels the model runner picks
    for the same flags: RMSNorm, rotary and activation each run on them, none declined."""
    args = ServerArgs(model_path="unused", dtype=dtype)
    device = torch.device("cpu")
    dtype_used, _ = engine_linears(args, device)
    kernels = engine_kernels(args, device)
    assert kernels is not None  # the suite's CPUs all build them
    declined = dict(kernels.fallbacks)
    costs = measure_pointwise(device, seconds=0.03, dtype=dtype_used, kernels=kernels)
    assert costs.norm_s > 0 and costs.rotary_s > 0 and costs.activation_s > 0
    assert min(costs.norm_call_s, costs.rotary_call_s, costs.activation_call_s) >= 0
    # None of the three fell back to torch's ops (a declined native op is counted).
    assert dict(kernels.fallbacks) == declined


def test_a_pointwise_ops_cost_per_value_and_per_call_come_from_one_token_and_a_prompt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The line through an op's time on one token and on a prompt's tokens: its slope is the cost
    per value, what it leaves of one token's time the cost per call. Times are given, not taken."""
    seen: list[int] = []

    def given_rate(work: Callable[[], object], units: float, seconds: float, device: torch.device) -> float:
        work()
        return units / (7e-6 + seen[-1] * 100 * 2e-9)  # 7 us a call, 2 ns a value, 100 values a token

    monkeypatch.setattr(peaks, "_rate", given_rate)
    per_value, per_call = peaks._per_value_and_call(seen.append, 100, 256, 1.0, torch.device("cpu"))
    assert seen == [1, 256]
    assert per_value == pytest.approx(2e-9) and per_call == pytest.approx(7e-6)


@pytest.mark.parametrize("backend", ["auto", "torch_native"])
def test_a_prompts_and_an_extends_attention_are_timed_on_the_engines_backend(
    tiny_model_dir: Callable[[str], Path], backend: str
) -> None:
    """A prompt's attention, and an extend's over a cached prefix, are timed on the backend the
    model runner picks for the same flags (the native one on a CPU by default, torch's when asked
    for): for each length (or shape) asked, per query head and unit of head dim."""
    model = str(tiny_model_dir("llama"))
    args = ServerArgs(model_path=model, dtype="bfloat16", max_total_tokens=256, attention_backend=backend)
    runner = ModelRunner(RunnerConfig.from_server_args(args))
    try:
        chosen = runner.describe()["attention_backend"]
    finally:
        runner.close()
    attention = engine_attention(args, torch.device("cpu"))
    assert attention.name == chosen
    kernels = attention.spec.kernels
    declined = None if kernels is None else dict(kernels.fallbacks)
    table = measure_prompt_attention(attention, seconds=0.05, lengths=(1, 16, 512))
    assert [tokens for tokens, _ in table] == [1, 16, 512]
    # 512 tokens attend 262,144 pairs where one token attends one.
    assert all(seconds > 0 for _, seconds in table) and table[-1][1] > table[0][1]
    extends = measure_extend_attention(attention, seconds=0.05, shapes=((64, 512), (4, 16)))
    # By the pairs each reads, fewest first: 4 x 20 and 64 x 576.
    assert [pairs for pairs, _ in extends] == [80, 36_864]
    # (Which takes longer is the machine's business: a test holds no figure of its speed.)
    assert all(seconds > 0 for _, seconds in extends)
    if kernels is not None:
        assert dict(kernels.fallbacks) == declined


def _sample(scale: float, flops: float) -> HardwareProfile:
    """One measurement of the peaks, its times `scale` times a reference's."""
    overlap = tuple((rows, scale * (0.01 + 0.002 * rows)) for rows in OVERLAP_ROWS)
    return HardwareProfile(
        "cpu",
        flops,
        peaks.overlap_stack_bytes(torch.bfloat16) / (0.01 * scale),
        8e9,
        linear_rates=((512, 100e9 / scale), (2048, 120e9 / scale)),
        pointwise=PointwiseCosts(norm_s=scale * 1e-9, activation_call_s=scale * 1e-5),
        decode_overlap=overlap,
        prompt_attention=((1, scale * 1e-7), (64, scale * 4e-7)),
        extend_attention=((1040, scale * 6e-7),),
    )


def test_peaks_measured_between_the_passes_are_taken_at_their_medians() -> None:
    """calibrate measures the peaks after each timed pass; the profile holds each figure's median,
    entry by entry, and the weights' bandwidth read off the median stack, so that one slow or fast
    moment of the host does not set the rates every efficiency is a share of."""
    samples = [_sample(1.0, 150e9), _sample(1.5, 120e9), _sample(0.9, 170e9)]
    median = median_measurements(samples, torch.bfloat16)
    middle = _sample(1.0, 150e9)
    assert median.peak_flops == 150e9 and median.memory_bytes == 8e9
    assert median.linear_rates == middle.linear_rates
    assert median.decode_overlap == middle.decode_overlap
    assert median.prompt_attention == middle.prompt_attention
    assert median.extend_attention == middle.extend_attention
    assert median.pointwise == middle.pointwise
    assert median.memory_bandwidth == weights_bandwidth(middle.decode_overlap, torch.bfloat16)
    # Entry by entry: a table's median need not be any one sample's.
    mixed = dataclasses.replace(samples[2], linear_rates=((512, 90e9), (2048, 200e9)))
    rates = median_measurements([samples[0], samples[1], mixed], torch.bfloat16).linear_rates
    assert rates == ((512, 90e9), (2048, 120e9))
    with pytest.raises(ValueError, match="not of the same sizes"):
        narrower = dataclasses.replace(mixed, linear_rates=((576, 1e11),))
        median_measurements([samples[0], narrower], torch.bfloat16)
    with pytest.raises(ValueError, match="no measurement"):
        median_measurements([], torch.bfloat16)
