"""A roofline of one forward: the FLOPs and bytes a batch moves through the model, attention
included, on a hardware profile. Time = the larger of compute (matmuls at the profile's
efficiencies, and the pointwise ops at their measured rates) and memory time, or on a device where
they overlap only in part a norm between that and their sum, plus its fixed costs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from radixserve.models.config import ModelConfig
from radixserve_tools.simulator.hardware import HardwareProfile, PointwiseCosts


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    dtype_bytes: int = 2

    @classmethod
    def of(cls, config: ModelConfig, dtype_bytes: int = 2) -> ModelShape:
        return cls(
            config.num_hidden_layers,
            config.hidden_size,
            config.intermediate_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            config.vocab_size,
            dtype_bytes,
        )

    @property
    def layer_params(self) -> int:
        q_out, kv_out = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.hidden * (q_out + 2 * kv_out) + q_out * self.hidden + 3 * self.hidden * self.intermediate

    @property
    def weight_bytes(self) -> int:
        """Every weight a forward reads: the layers and the LM head (the embedding rows are few)."""
        return (self.layers * self.layer_params + self.vocab * self.hidden) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class SharedPrefix:
    """A cached prefix that several requests of a batch share (the very same KV slots): its
    length, those requests, and their new tokens, which a cascade attention backend attends to it
    in one GEMM-shaped call, reading its K/V once instead of once per request."""

    length: int
    requests: int
    queries: int


@dataclass(frozen=True)
class ForwardShape:
    """Per request: new tokens and the tokens already in its KV; how many rows sample; and whether
    it is a decode step (one new token per request; its fixed cost may differ from a prefill's)."""

    q_lens: list[int]
    prefix_lens: list[int]
    sampled_rows: int
    decode: bool = False
    shared_prefixes: tuple[SharedPrefix, ...] = ()
    # The requests (indices into q_lens) whose cached prefix is one of shared_prefixes: a cascade
    # attends theirs apart from the masked call each other request's extend runs.
    cascade_requests: tuple[int, ...] = ()

    @property
    def shared_kv_reads(self) -> int:
        """K/V tokens of the shared prefixes, counted once per request beyond the first: the reads
        a cascade saves."""
        return sum((p.requests - 1) * p.length for p in self.shared_prefixes)

    @property
    def shared_pairs(self) -> int:
        """(query, key) pairs of new tokens over the shared prefixes: what a cascade attends."""
        return sum(p.queries * p.length for p in self.shared_prefixes)

    @property
    def shared_prefix_tokens(self) -> int:
        """The shared prefixes' K/V tokens, once per prefix: what a cascade reads and stages."""
        return sum(p.length for p in self.shared_prefixes)


@dataclass(frozen=True)
class ForwardWork:
    """What one forward does: FLOPs of the linears (and LM head), FLOPs of attention (which runs at
    its own efficiency: far below a matmul's on a CPU), bytes moved, new tokens, and the rows that
    sample (one per request that gets a next token). Attention is split in two: the new tokens
    among themselves (a prompt's causal attention) and the new tokens over the context already in
    the KV cache (every decode step's, and an extend's over a cached prefix), which run different
    kernels at different efficiencies (a few query rows against many keys, from the KV pool); and
    of the latter, a cascade backend attends a prefix that several requests share in one call for
    all their queries, at an efficiency of its own."""

    linear_flops: float
    attention_flops: float
    bytes: float
    tokens: int
    decode: bool = False
    shared_bytes: float = 0.0  # of `bytes`: what a cascade reads once instead of per request
    rows: int = 0
    context_attention_flops: float = 0.0
    shared_context_flops: float = 0.0  # of context_attention_flops: over prefixes a batch shares
    shared_prefix_keys: float = 0.0  # K/V tokens (per layer) a cascade's calls read of those prefixes
    width: int = 0  # the model's hidden size: its linears' rate depends on it (linear_peak)
    # Values through each layer's pointwise ops, summed over layers (HardwareProfile.pointwise).
    norm_values: float = 0.0
    rotary_values: float = 0.0
    activation_values: float = 0.0
    # Calls of each pointwise op (PointwiseCosts' *_call_s): per layer of a forward run layer by
    # layer, none in a decode step (one native call for every layer on a CPU).
    norm_calls: int = 0
    rotary_calls: int = 0
    activation_calls: int = 0
    # Seconds of attention at a profile's measured costs: the new tokens' among themselves
    # (HardwareProfile.prompt_attention), in place of attention_flops (then 0), and an extend's
    # whole over a cached prefix no cascade attends (HardwareProfile.extend_attention).
    causal_attention_s: float = 0.0

    @property
    def flops(self) -> float:
        return self.linear_flops + self.attention_flops + self.context_attention_flops


def causal_pairs(q_len: int, block: int = 1) -> int:
    """Query-key pairs of q_len new tokens among themselves that a kernel masking by blocks of
    `block` keys computes: each block of queries, every key up to its block's end (block 1: each
    token sees the tokens up to itself, q_len * (q_len + 1) / 2)."""
    full, rest = divmod(q_len, block)
    return block * block * full * (full + 1) // 2 + rest * q_len


def forward_work(
    shape: ModelShape,
    fwd: ForwardShape,
    attention_block: int = 1,
    prompt_attention: Callable[[int], float] | None = None,
    extend_attention: Callable[[int], float] | None = None,
    cascade: bool = False,
) -> ForwardWork:
    """attention_block: as HardwareProfile.attention_block. prompt_attention: seconds per layer,
    query head and unit of head dim of a prompt's attention by its length (HardwareProfile.
    prompt_attention_s), which then prices each request's new tokens among themselves; a decode
    step's new token is then priced with its context, in the same kernel call. extend_attention:
    the same of an extend over a cached prefix by the pairs its call reads (HardwareProfile.
    extend_attention_s), which then prices the whole attention of each request that extends a
    cached prefix, bar those a cascade attends (`cascade`: whether the attention has one)."""
    tokens = sum(fwd.q_lens)
    linear = 2.0 * tokens * shape.layers * shape.layer_params
    linear += 2.0 * fwd.sampled_rows * shape.hidden * shape.vocab  # the LM head
    # Attention: QK^T and PV, each 2 FLOPs per (query, key, head dim); a new token sees the prefix
    # and the new tokens up to itself (or to its block's end).
    per_unit = shape.layers * shape.heads * shape.head_dim
    per_pair = 4.0 * per_unit
    causal_s = 0.0
    if fwd.decode:  # one new token per request (sums without a per-request Python loop)
        rows, cached = len(fwd.q_lens), sum(fwd.prefix_lens)
        causal, over_context, context = per_pair * rows, per_pair * cached, rows + cached
        if prompt_attention is not None:
            causal, over_context = 0.0, over_context + per_pair * rows
    else:
        segments = list(zip(fwd.q_lens, fwd.prefix_lens, strict=True))
        if extend_attention is not None:
            cascaded = set(fwd.cascade_requests) if cascade else set()
            alone = [i for i, (_, p) in enumerate(segments) if p and i not in cascaded]
            causal_s = per_unit * sum(extend_attention(q * (p + q)) for q, p in (segments[i] for i in alone))
            for i in reversed(alone):  # priced whole: neither their causal part nor their context
                del segments[i]
        if prompt_attention is None:
            causal = per_pair * sum(causal_pairs(q, attention_block) for q, _ in segments)
        else:
            causal = 0.0
            causal_s += per_unit * sum(prompt_attention(q) for q, _ in segments)
        over_context = per_pair * sum(q * p for q, p in segments)
        context = sum(q + p for q, p in zip(fwd.q_lens, fwd.prefix_lens, strict=True))
    moved = shape.weight_bytes + (context + tokens) * shape.kv_bytes_per_token
    shared = float(fwd.shared_kv_reads * shape.kv_bytes_per_token)
    shared_pairs = per_pair * fwd.shared_pairs
    keys = float(shape.layers * fwd.shared_prefix_tokens)
    token_layers = float(tokens * shape.layers)
    layer_calls = 0 if fwd.decode else shape.layers  # a decode step: one native call for all layers
    return ForwardWork(
        linear_flops=linear,
        attention_flops=causal,
        bytes=float(moved),
        tokens=tokens,
        decode=fwd.decode,
        shared_bytes=shared,
        rows=fwd.sampled_rows,
        context_attention_flops=over_context,
        shared_context_flops=shared_pairs,
        shared_prefix_keys=keys,
        width=shape.hidden,
        norm_values=token_layers * 2 * shape.hidden,  # before attention and before the MLP
        rotary_values=token_layers * (shape.heads + shape.kv_heads) * shape.head_dim,
        activation_values=token_layers * shape.intermediate,
        causal_attention_s=causal_s,
        # Two norms a layer, and the final one where a row samples; one rotary call a layer for
        # its query and key heads together, one activation.
        norm_calls=2 * layer_calls + int(layer_calls > 0 and fwd.sampled_rows > 0),
        rotary_calls=layer_calls,
        activation_calls=layer_calls,
    )


def profile_work(shape: ModelShape, fwd: ForwardShape, profile: HardwareProfile) -> ForwardWork:
    """forward_work as `profile` prices it: its causal block, or its measured prompt and extend
    attention."""
    prompt = profile.prompt_attention_s if profile.prompt_attention else None
    extend = profile.extend_attention_s if profile.extend_attention else None
    return forward_work(shape, fwd, profile.attention_block, prompt, extend, profile.cascade_attention)


def pointwise_terms(work: ForwardWork, costs: PointwiseCosts) -> tuple[float, float, float]:
    """What a forward's norms, rotary embedding and activation take at `costs`' measured rates and
    costs per call."""
    return (
        work.norm_values * costs.norm_s + work.norm_calls * costs.norm_call_s,
        work.rotary_values * costs.rotary_s + work.rotary_calls * costs.rotary_call_s,
        work.activation_values * costs.activation_s + work.activation_calls * costs.activation_call_s,
    )


def pointwise_seconds(work: ForwardWork, costs: PointwiseCosts) -> float:
    return sum(pointwise_terms(work, costs))


@dataclass(frozen=True)
class ComputeTerms:
    """A forward's compute seconds on a profile, by the part of the model that spends them (what
    simulator/components.py times in place, to set each against its measured share)."""

    linear: float
    attention: float  # causal, over a cached context, over shared prefixes, and their keys
    norm: float
    rotary: float
    activation: float

    @property
    def total(self) -> float:
        return self.linear + self.attention + self.norm + self.rotary + self.activation


def compute_terms(work: ForwardWork, profile: HardwareProfile) -> ComputeTerms:
    attention_efficiency = profile.attention_efficiency or profile.flops_efficiency
    context_efficiency = profile.context_attention_efficiency or attention_efficiency
    if work.decode and profile.decode_attention_efficiency is not None:
        context_efficiency = profile.decode_attention_efficiency
    shared_efficiency = profile.shared_prefix_attention_efficiency or context_efficiency
    linear_efficiency = profile.flops_efficiency
    if work.decode and profile.decode_flops_efficiency is not None:
        linear_efficiency = profile.decode_flops_efficiency
    attention = work.attention_flops / (profile.peak_flops * attention_efficiency) + work.causal_attention_s
    shared = work.shared_context_flops if profile.cascade_attention else 0.0
    attention += (work.context_attention_flops - shared) / (profile.peak_flops * context_efficiency)
    attention += shared / (profile.peak_flops * shared_efficiency)
    if profile.cascade_attention:
        attention += work.shared_prefix_keys * profile.shared_prefix_key_s
    linear = work.linear_flops / (profile.linear_peak(work.width) * linear_efficiency)
    return ComputeTerms(linear, attention, *pointwise_terms(work, profile.pointwise))


def work_seconds(work: ForwardWork, profile: HardwareProfile) -> float:
    compute = compute_terms(work, profile).total
    moved = work.bytes - work.shared_bytes if profile.cascade_attention else work.bytes
    memory = moved / (profile.memory_bandwidth * profile.bandwidth_efficiency)
    overhead = profile.forward_overhead_s
    if work.decode and profile.decode_overhead_s is not None:
        overhead = profile.decode_overhead_s
    per_item = profile.token_overhead_s * work.tokens + profile.row_overhead_s * work.rows
    return profile.roofline(compute, memory, work.decode) + overhead + per_item


def forward_seconds(shape: ModelShape, profile: HardwareProfile, fwd: ForwardShape) -> float:
    return work_seconds(profile_work(shape, fwd, profile), profile)


def wake_share(profile: HardwareProfile, idle_s: float) -> float:
    """The share of HardwareProfile.idle_wake_s a forward pays after the device idled `idle_s`."""
    return min(1.0, max(0.0, idle_s) / profile.idle_wake_after_s)


def wake_seconds(profile: HardwareProfile, idle_s: float) -> float:
    """What a forward costs more after the device idled for `idle_s`."""
    return profile.idle_wake_s * wake_share(profile, idle_s) if profile.idle_wake_s else 0.0
