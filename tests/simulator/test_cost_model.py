"""The roofline (simulator/cost_model.py): decode is bound by the bytes it reads, a long prefill by
its FLOPs, and attention grows with the context."""

from __future__ import annotations

import dataclasses

import pytest

from radixserve.models.config import ModelConfig
from radixserve_tools.simulator.cost_model import (
    ForwardShape,
    ModelShape,
    SharedPrefix,
    causal_pairs,
    compute_terms,
    forward_seconds,
    forward_work,
    profile_work,
)
from radixserve_tools.simulator.hardware import (
    BUILTIN_PROFILES,
    HardwareProfile,
    PointwiseCosts,
    load_profile,
)
from radixserve_tools.simulator.model_configs import BUILTIN_MODEL_CONFIGS

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
    # Attention: the same new tokens over a cached prefix cost more, counted as attention over the
    # context (its own efficiency where the profile sets one); among themselves, the same.
    longer = ForwardShape([4096], [4096], 1)
    over_prefix = forward_work(s, longer)
    assert over_prefix.context_attention_flops == pytest.approx(4 * 32 * 32 * 128 * 4096 * 4096)
    assert work.context_attention_flops == 0
    assert over_prefix.attention_flops == work.attention_flops
    assert over_prefix.flops - work.flops == pytest.approx(over_prefix.context_attention_flops)
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
    # Without its own efficiency, attention over the context runs at attention's; with one, at it.
    expected = (over_prefix.linear_flops + 10 * over_prefix.attention_flops) / h100.peak_flops
    same = expected + 10 * over_prefix.context_attention_flops / h100.peak_flops
    assert forward_seconds(s, slow_attention, longer) == pytest.approx(same)
    slower_context = dataclasses.replace(slow_attention, context_attention_efficiency=0.05)
    own = expected + 20 * over_prefix.context_attention_flops / h100.peak_flops
    assert forward_seconds(s, slower_context, longer) == pytest.approx(own)
    # A cascade attends a prefix the batch shares at its own efficiency; without one, no pair is
    # shared.
    # (512 new tokens each: compute-bound.)
    four = ForwardShape([512] * 4, [4096] * 4, 4, shared_prefixes=(SharedPrefix(4096, 4, 4 * 512),))
    assert (four.shared_kv_reads, four.shared_pairs, four.shared_prefix_tokens) == (
        3 * 4096,
        4 * 512 * 4096,
        4096,
    )
    work4 = forward_work(s, four)
    assert work4.shared_context_flops == pytest.approx(4 * 32 * 32 * 128 * 4 * 512 * 4096)
    cascade = dataclasses.replace(
        slower_context, cascade_attention=True, shared_prefix_attention_efficiency=0.5
    )
    rest = work4.context_attention_flops - work4.shared_context_flops
    expected4 = work4.linear_flops + 10 * work4.attention_flops + 20 * rest + 2 * work4.shared_context_flops
    assert forward_seconds(s, cascade, four) == pytest.approx(expected4 / h100.peak_flops)
    expected4 = work4.linear_flops + 10 * work4.attention_flops + 20 * work4.context_attention_flops
    assert forward_seconds(s, slower_context, four) == pytest.approx(expected4 / h100.peak_flops)
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


def test_linears_run_at_the_rate_of_their_models_width(tmp_path: object) -> None:
    """A profile with linear rates prices a model's linears at the rate of its hidden size,
    interpolated in the log of the width and held at the ends; attention stays at the peak."""
    from pathlib import Path

    rates = ((512, 1e11), (2048, 2e11))
    profile = HardwareProfile("cpu", 1.5e11, 1e15, 2e10, 1.0, 1.0, 0.0, linear_rates=rates)
    assert HardwareProfile("gpu", 1.5e11, 1e15, 2e10).linear_peak(4096) == 1.5e11  # no rates
    assert [profile.linear_peak(w) for w in (256, 512, 2048, 8192)] == [1e11, 1e11, 2e11, 2e11]
    assert profile.linear_peak(1024) == pytest.approx(1.5e11)  # halfway in the log
    s = shape()  # 4096 wide: the widest rate
    prefill = ForwardShape([512], [0], 1)
    work = forward_work(s, prefill)
    assert work.width == 4096
    attention = work.attention_flops / 1.5e11
    assert forward_seconds(s, profile, prefill) == pytest.approx(work.linear_flops / 2e11 + attention)
    path = Path(str(tmp_path)) / "cpu.json"
    profile.save(path)
    assert load_profile(str(path)) == profile  # the pairs come back as tuples


def test_pointwise_ops_cost_their_values_at_the_measured_rates(tmp_path: object) -> None:
    """Each layer's two norms (hidden values each), rotary embedding (query and key heads) and
    activation (intermediate values) per new token, priced at the profile's measured cost per
    value beside the linears; a profile keeps them through its JSON."""
    from pathlib import Path

    s = shape()  # Llama-8B: 32 layers, 4096 wide, 32 + 8 heads of 128, 14336 intermediate
    prefill = ForwardShape([100, 28], [0, 0], 2)
    work = forward_work(s, prefill)
    token_layers = 128 * 32
    assert work.norm_values == token_layers * 2 * 4096
    assert work.rotary_values == token_layers * (32 + 8) * 128
    assert work.activation_values == token_layers * 14336
    costs = PointwiseCosts(norm_s=1e-9, rotary_s=2e-9, activation_s=4e-9)
    bare = HardwareProfile("cpu", 1e12, 1e15, 2e10, 1.0, 1.0, 0.0)
    priced = dataclasses.replace(bare, pointwise=costs)
    extra = work.norm_values * 1e-9 + work.rotary_values * 2e-9 + work.activation_values * 4e-9
    assert forward_seconds(s, priced, prefill) == pytest.approx(forward_seconds(s, bare, prefill) + extra)
    path = Path(str(tmp_path)) / "cpu.json"
    priced.save(path)
    assert load_profile(str(path)) == priced


def test_pointwise_calls_cost_per_layer_in_a_prefill_and_nothing_in_a_decode_step(tmp_path: object) -> None:
    """Each op's cost per call is paid per layer by a forward run layer by layer (two norms, one
    rotary call, one activation, and the final norm where a row samples), whatever its tokens; a
    decode step runs its layers in one native call and pays none. A profile keeps them."""
    from pathlib import Path

    s = shape()  # 32 layers
    values = PointwiseCosts(norm_s=1e-9, rotary_s=2e-9, activation_s=4e-9)
    calls = dataclasses.replace(values, norm_call_s=10e-6, rotary_call_s=20e-6, activation_call_s=40e-6)
    bare = HardwareProfile("cpu", 1e12, 1e15, 2e10, 1.0, 1.0, 0.0)
    by_values, by_calls = (dataclasses.replace(bare, pointwise=costs) for costs in (values, calls))
    for fwd, norms in ((ForwardShape([100, 28], [0, 0], 2), 65), (ForwardShape([64], [512], 0), 64)):
        work = forward_work(s, fwd)
        assert (work.norm_calls, work.rotary_calls, work.activation_calls) == (norms, 32, 32)
        extra = norms * 10e-6 + 32 * 20e-6 + 32 * 40e-6
        assert forward_seconds(s, by_calls, fwd) == pytest.approx(forward_seconds(s, by_values, fwd) + extra)
    step = ForwardShape([1] * 8, [512] * 8, 8, decode=True)
    assert forward_work(s, step).norm_calls == 0
    assert forward_seconds(s, by_calls, step) == forward_seconds(s, by_values, step)
    path = Path(str(tmp_path)) / "cpu.json"
    by_calls.save(path)
    assert load_profile(str(path)) == by_calls


def test_memory_and_compute_combine_by_the_profiles_norm() -> None:
    """A roofline takes the larger of a forward's compute and memory times; a device whose reads
    overlap a decode step's compute in part, their p-norm (memory_compute_norm; 1: their sum)."""
    s = shape()
    step = ForwardShape([1] * 8, [512] * 8, 8, decode=True)
    roofline = HardwareProfile("cpu", 1e12, 1e11, 2e10, 1.0, 1.0, 0.0)
    compute_only = dataclasses.replace(roofline, memory_bandwidth=1e30)
    memory_only = dataclasses.replace(roofline, peak_flops=1e30)
    compute, memory = forward_seconds(s, compute_only, step), forward_seconds(s, memory_only, step)
    assert forward_seconds(s, roofline, step) == pytest.approx(max(compute, memory))
    adding = dataclasses.replace(roofline, memory_compute_norm=1.0)
    assert forward_seconds(s, adding, step) == pytest.approx(compute + memory)
    partial = dataclasses.replace(roofline, memory_compute_norm=2.0)
    assert forward_seconds(s, partial, step) == pytest.approx((compute**2 + memory**2) ** 0.5)
    # A prefill's rows hide its weights' reads whatever the norm: the larger of the two.
    prompt = ForwardShape([64], [0], 1)
    compute, memory = forward_seconds(s, compute_only, prompt), forward_seconds(s, memory_only, prompt)
    assert compute > memory
    assert forward_seconds(s, adding, prompt) == forward_seconds(s, roofline, prompt)
    assert forward_seconds(s, roofline, prompt) == pytest.approx(compute)


def test_causal_attention_by_blocks() -> None:
    """A kernel that masks by blocks of keys computes each query block's keys up to the block's
    end: a prompt within one block costs its full square, a long one about half plus a block."""
    assert causal_pairs(6) == 21  # each token sees the tokens up to itself
    assert causal_pairs(300, 512) == 300 * 300
    assert causal_pairs(1024, 512) == 512 * 512 + 512 * 1024
    assert causal_pairs(1100, 512) == 512 * 512 + 512 * 1024 + 76 * 1100
    assert causal_pairs(4096, 1) == 4096 * 4097 // 2
    s, h100 = shape(), BUILTIN_PROFILES["H100"]
    prompt = ForwardShape([300], [0], 1)
    blocked = dataclasses.replace(h100, attention_block=512)
    assert forward_work(s, prompt, 512).attention_flops == pytest.approx(
        forward_work(s, prompt).attention_flops * 300 * 300 / (300 * 301 / 2)
    )
    assert forward_seconds(s, blocked, prompt) > forward_seconds(s, h100, prompt)
    # The cached prefix is attended whole either way.
    extend = ForwardShape([64], [512], 1)
    assert (
        forward_work(s, extend, 512).context_attention_flops
        == forward_work(s, extend).context_attention_flops
    )


def test_a_measured_prompt_attention_prices_each_requests_new_tokens(tmp_path: object) -> None:
    """A profile that measured a prompt's attention by its length prices each request's new tokens
    among themselves from it (per layer, query head and unit of head dim), interpolated in the
    logs between lengths, the shortest's below them and growing with the square beyond the
    longest; the cached context stays FLOPs at its efficiency, and a decode step's new token is
    priced with its context (the same kernel call). A profile keeps it through its JSON."""
    from pathlib import Path

    table = ((1, 2e-8), (64, 1e-7), (256, 8e-7))
    base = HardwareProfile("cpu", 1e12, 1e15, 2e10, 1.0, 1.0, 0.0, context_attention_efficiency=0.5)
    measured = dataclasses.replace(base, prompt_attention=table)
    assert [measured.prompt_attention_s(n) for n in (1, 64, 256)] == [2e-8, 1e-7, 8e-7]
    assert measured.prompt_attention_s(0) == 2e-8  # held below the shortest
    assert measured.prompt_attention_s(128) == pytest.approx((1e-7 * 8e-7) ** 0.5)  # halfway in the logs
    assert measured.prompt_attention_s(1024) == pytest.approx(8e-7 * 16)  # the square beyond
    s = shape()  # Llama-8B: 32 layers, 32 query heads of 128
    units = 32 * 32 * 128
    extend = ForwardShape([64, 128], [0, 512], 2)
    work = profile_work(s, extend, measured)
    assert work.attention_flops == 0.0
    assert work.causal_attention_s == pytest.approx(units * (1e-7 + measured.prompt_attention_s(128)))
    flops_work = forward_work(s, extend)
    assert work.context_attention_flops == flops_work.context_attention_flops
    saved = compute_terms(flops_work, base).attention - flops_work.attention_flops / 1e12
    assert compute_terms(work, measured).attention == pytest.approx(saved + work.causal_attention_s)
    step = ForwardShape([1] * 4, [300] * 4, 4, decode=True)
    decode_work = profile_work(s, step, measured)
    assert decode_work.attention_flops == 0.0 and decode_work.causal_attention_s == 0.0
    assert decode_work.context_attention_flops == 4.0 * 32 * 32 * 128 * 4 * 301
    path = Path(str(tmp_path)) / "cpu.json"
    measured.save(path)
    assert load_profile(str(path)) == measured


def test_a_measured_extend_attention_prices_an_extend_over_its_own_prefix_whole(tmp_path: object) -> None:
    """A profile that measured an extend's attention over a cached prefix by the (query, key) pairs
    its call reads prices each request that extends a prefix no cascade attends from it: its new
    tokens x (prefix + new tokens) pairs, per layer, query head and unit of head dim, in place of
    its causal part and its FLOPs over the context. Interpolated in the logs between measured
    pairs, the smallest's value below them, in proportion beyond the largest. A request a cascade
    attends keeps its causal part and its shared context as before; without a cascade every
    extend over a prefix is priced so. A profile keeps the table through its JSON."""
    from pathlib import Path

    prompt = ((1, 2e-8), (64, 1e-7), (256, 8e-7))
    table = ((1_000, 1e-7), (100_000, 1e-5))
    base = HardwareProfile("cpu", 1e12, 1e15, 2e10, 1.0, 1.0, 0.0, context_attention_efficiency=0.5)
    measured = dataclasses.replace(base, prompt_attention=prompt, extend_attention=table)
    assert measured.extend_attention_s(10) == 1e-7  # held below the smallest
    assert measured.extend_attention_s(10_000) == pytest.approx(1e-6)  # halfway in the logs
    assert measured.extend_attention_s(200_000) == pytest.approx(2e-5)  # in proportion beyond
    s = shape()  # Llama-8B: 32 layers, 32 query heads of 128
    units = 32 * 32 * 128
    # A prompt, one extend over a prefix of its own, and two over a prefix they share.
    batch = ForwardShape(
        [64, 16, 8, 8],
        [0, 96, 512, 512],
        4,
        shared_prefixes=(SharedPrefix(512, 2, 16),),
        cascade_requests=(2, 3),
    )
    alone = measured.extend_attention_s(16 * 112)
    cascading = dataclasses.replace(measured, cascade_attention=True)
    work = profile_work(s, batch, cascading)
    assert work.attention_flops == 0.0
    own = measured.prompt_attention_s(64) + 2 * measured.prompt_attention_s(8)
    assert work.causal_attention_s == pytest.approx(units * (alone + own))
    assert work.context_attention_flops == work.shared_context_flops == 4.0 * units * 16 * 512
    # Without a cascade the two sharing a prefix extend over it alone too.
    work = profile_work(s, batch, measured)
    each = measured.extend_attention_s(8 * 520)
    expected = measured.prompt_attention_s(64) + alone + 2 * each
    assert work.causal_attention_s == pytest.approx(units * expected)
    assert work.context_attention_flops == 0.0
    # A prompt with no cached prefix is the prompt table's alone.
    assert profile_work(s, ForwardShape([64], [0], 1), measured).causal_attention_s == pytest.approx(
        units * measured.prompt_attention_s(64)
    )
    path = Path(str(tmp_path)) / "cpu.json"
    measured.save(path)
    assert load_profile(str(path)) == measured
