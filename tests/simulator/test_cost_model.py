"""The roofline (simulator/cost_model.py): decode is bound by the bytes it reads, a long prefill by
its FLOPs, and attention grows with the context."""

from __future__ import annotations

import dataclasses

import pytest

from radixserve.models.config import ModelConfig
from radixserve.simulator.cost_model import ForwardShape, ModelShape, forward_seconds, forward_work
from radixserve.simulator.hardware import BUILTIN_PROFILES, HardwareProfile, load_profile
from radixserve.simulator.model_configs import BUILTIN_MODEL_CONFIGS

LLAMA_8B = BUILTIN_MODEL_CONFIGS["llama-3.1-8b"]


def shape() -> ModelShape:
    return ModelShape.of(ModelConfig.from_hf_dict(LLAMA_8B))


def test_parameter_and_kv_sizes_of_llama_8b() -> None:
    s = shape()
    # 7.5 B in the layers and the LM head (the embedding's rows are gathered, not read whole).
    assert s.weight_bytes / 2 == pytest.approx(7.50e9, rel=0.01)
    assert s.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2


def test_decode_is_memory_bound_and_prefill_compute_bound() -> None:
    s, h100 = shape(), BUILTIN_PROFILES["H100"]
    bare = HardwareProfile("bare", h100.peak_flops, h100.memory_bandwidth, h100.memory_bytes, 1.0, 1.0, 0.0)
    decode = ForwardShape([1] * 8, [1000] * 8, 8)
    work = forward_work(s, decode)
    flops, moved = work.flops, work.bytes
    assert forward_seconds(s, bare, decode) == pytest.approx(moved / h100.memory_bandwidth)
    assert flops / h100.peak_flops < moved / h100.memory_bandwidth
    prefill = ForwardShape([4096], [0], 1)
    work = forward_work(s, prefill)
    flops, moved = work.flops, work.bytes
    assert forward_seconds(s, bare, prefill) == pytest.approx(flops / h100.peak_flops)
    # Attention: the same new tokens over a longer prefix cost more.
    longer = ForwardShape([4096], [4096], 1)
    assert forward_work(s, longer).attention_flops - work.attention_flops == pytest.approx(
        4 * 32 * 32 * 128 * 4096 * 4096
    )
    # Attention at its own efficiency: a tenth of the linears' makes its share ten times slower.
    slow_attention = HardwareProfile(
        "a",
        bare.peak_flops,
        bare.memory_bandwidth,
        bare.memory_bytes,
        1.0,
        1.0,
        0.0,
        attention_efficiency=0.1,
    )
    expected = (work.linear_flops + 10 * work.attention_flops) / h100.peak_flops
    assert forward_seconds(s, slow_attention, prefill) == pytest.approx(expected)
    # Fixed costs add once per forward and per token.
    slow = HardwareProfile(
        "slow", bare.peak_flops, bare.memory_bandwidth, bare.memory_bytes, 1.0, 1.0, 1e-3, 1e-6
    )
    assert forward_seconds(s, slow, decode) == pytest.approx(forward_seconds(s, bare, decode) + 1e-3 + 8e-6)
    # A decode step may have fixed costs of its own (host work a prefill amortizes on a GPU).
    host_bound = dataclasses.replace(slow, decode_overhead_s=30e-3)
    step = dataclasses.replace(decode, decode=True)
    expected_step = forward_seconds(s, bare, step) + 30e-3 + 8e-6
    assert forward_seconds(s, host_bound, step) == pytest.approx(expected_step)
    assert forward_seconds(s, host_bound, prefill) == pytest.approx(forward_seconds(s, slow, prefill))


def test_profiles_by_name_or_file(tmp_path: object) -> None:
    from pathlib import Path

    assert load_profile("h200").memory_bandwidth == 4.8e12
    path = Path(str(tmp_path)) / "cpu.json"
    custom = HardwareProfile("cpu", 1e12, 1e11, 2e10, 0.3, 0.5, 1e-3, 2e-5, note="calibrated")
    custom.save(path)
    assert load_profile(str(path)) == custom
    with pytest.raises(ValueError, match="neither a built-in profile"):
        load_profile("TPU")
