"""Hardware profiles for the cost model: peak dense bf16 FLOP/s and memory bandwidth from the
vendors' published figures, and the share of those peaks a forward reaches plus its fixed costs
(which `radixserve calibrate` fits on the machine it runs on; the GPU profiles carry defaults)."""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from radixserve.config.server_args import InvalidArgumentError


@dataclass(frozen=True)
class PointwiseCosts:
    """Seconds per value of a layer's work outside its matmuls, on the engine's own ops: RMSNorm
    (per value normed), the rotary embedding (per query and key value rotated) and SiLU-and-multiply
    (per value out). It costs a narrow model a larger share of its time than a wide one (on a
    2-core Zen 3, a fifth of a 576-wide layer's linears, a twentieth of a 2048-wide one's), so a
    profile fitted on one model must know it apart from the linears to predict another.

    Each op's call also costs seconds of its own whatever its size (Python, the dispatcher, the
    worker threads' start and join): the *_call_s fields, which a prefill or extend pays per layer
    and a short extend mostly pays. A decode step on the CPU runs every layer in one native call
    (models/fused_decode.py), so its steps do not pay them per op."""

    norm_s: float = 0.0
    rotary_s: float = 0.0
    activation_s: float = 0.0
    norm_call_s: float = 0.0
    rotary_call_s: float = 0.0
    activation_call_s: float = 0.0


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    peak_flops: float  # dense bf16 FLOP/s
    # bytes/s: published for a GPU profile; a calibrated one's is measured, the rate the engine's
    # linear streams weights (calibrate's fit then keeps bandwidth_efficiency at 1).
    memory_bandwidth: float
    memory_bytes: float  # device memory: weights plus the KV pool must fit
    flops_efficiency: float = 0.6
    bandwidth_efficiency: float = 0.8
    # Per forward (kernel launches, the host's share) and per new token (what grows with tokens
    # but is neither FLOPs nor bytes in the roofline).
    forward_overhead_s: float = 30e-6
    token_overhead_s: float = 0.0
    note: str = ""
    # The kind of device the profile describes ("cuda", "cpu"): the defaults a server takes there,
    # such as its prefill chunk, are the simulation's too.
    device_type: str = "cuda"
    # Attention's share of peak FLOP/s, where it differs from the linears' (None: the same).
    attention_efficiency: float | None = None
    # A decode step's fixed cost, where it differs from a prefill forward's (None: the same). On a
    # GPU, a small model's decode step can be bound by host work that a prefill amortizes.
    decode_overhead_s: float | None = None
    # Whether attention reads a prefix that several requests of a batch share once for all of
    # them (radixserve's CPU backend does: cascade attention), or once per request (torch SDPA,
    # radixserve's CUDA path; the GPU profiles model that).
    cascade_attention: bool = False
    # Per row that samples: the host's work for each request that gets a next token (sampling
    # inputs, appending and checking the token, its output), which a decode step pays per request
    # and a prefill per request, not per prompt token. `calibrate` holds it at what the engine's
    # scheduler measured of its own time per decode row (scheduler/stats.py's HostTimeLine).
    row_overhead_s: float = 0.0
    # A decode step's linears' share of peak FLOP/s, where it differs from a prefill's (None: the
    # same). On a CPU a prefill's activations spill out of the caches and a decode step's rows do
    # not; on a GPU a decode step's few rows leave the matmul units idle.
    decode_flops_efficiency: float | None = None
    # The share of peak FLOP/s of an extend's new tokens' attention over a cached prefix, where it
    # differs from a prompt's causal attention (None: attention_efficiency). On a CPU a few query
    # rows against a long context from the KV pool run at a fraction of a long prompt's attention.
    context_attention_efficiency: float | None = None
    # A decode step's attention (one query per request over its context), where it differs from
    # an extend's over a cached prefix (None: context_attention_efficiency): another kernel.
    decode_attention_efficiency: float | None = None
    # With cascade_attention: the share of peak FLOP/s of all a batch's queries over a prefix they
    # share, in one GEMM-shaped call (None: context_attention_efficiency).
    shared_prefix_attention_efficiency: float | None = None
    # With cascade_attention: seconds per K/V token and layer of that call's shared prefix (reading
    # and staging its keys and values, whatever the queries): what makes a cascade of a few
    # queries slow per FLOP and one of hundreds fast.
    shared_prefix_key_s: float = 0.0
    # The causal mask's granularity in a prompt's attention: the kernel computes every query-key
    # pair of a block of this many keys that any query of the block needs (1: exactly the causal
    # half). torch's CPU flash kernel skips keys in blocks of 512, so a prompt of up to 512
    # tokens costs its full square; `calibrate` picks the block that fits best.
    attention_block: int = 1
    # What the first forward after the device idled costs more than the same forward right after
    # another: clocks, caches and worker threads waking (`calibrate` times one extend both ways).
    # An idle spell of at least idle_wake_after_s pays all of it, a shorter one its share.
    idle_wake_s: float = 0.0
    idle_wake_after_s: float = 1.0
    # How much one forward's time varies on this device: the standard deviation of its log
    # (`calibrate` measures it on repeated single-forward runs). The simulator draws each forward's
    # time around the roofline's, mean kept: under load the spread itself lengthens queues, and
    # which requests share a prefill can turn on a few milliseconds.
    forward_noise: float = 0.0
    # The FLOP/s of the engine's linears in a model of each hidden size: (hidden size, FLOP/s)
    # pairs, widest last (`calibrate` times them). A matmul's rate depends on its shape: on a
    # 2-core Zen 3 a 2048-wide model's linears ran 1.2 times as fast as a 576-wide one's. The
    # efficiencies are shares of the rate at the model's width, so that a profile fitted on one
    # model predicts another's linears. Empty: peak_flops at every width (the GPU profiles).
    linear_rates: tuple[tuple[int, float], ...] = ()
    # How a decode step's compute and memory times combine: their p-norm, (c^p + m^p)^(1/p). None:
    # the larger of the two, the roofline (a GPU streams weights while its matmul units work);
    # 1: their sum (nothing overlaps); between, a partial overlap, as on a CPU whose few cores both
    # stream a decode step's weights and compute its rows (the step grows with its rows from the
    # first, slowly at first). `calibrate` picks it from decode_overlap where it measured that,
    # else keeps the one of MEMORY_COMPUTE_NORMS that fits best. A prefill or extend takes the
    # larger whatever the norm: its many rows per weight read hide the reads, as its parts timed
    # in place show (simulator/components.py, docs/simulator.md).
    memory_compute_norm: float | None = None
    # (rows, seconds) pairs: a stack of the engine's linears larger than any cache, timed for each
    # number of rows (`calibrate` measures it: peaks.measure_decode_overlap). How its time grows
    # from one row's (the weights' reading) as the rows' compute joins shows how the two combine
    # on this device, apart from the calibration model's other costs. Empty: not measured.
    decode_overlap: tuple[tuple[int, float], ...] = ()
    # (new tokens, seconds) pairs: the engine's attention over a prompt of that many tokens with
    # no cached prefix, per layer and per query head and unit of head dim (`calibrate` measures it:
    # peaks.measure_prompt_attention). Where present it prices every request's new tokens among
    # themselves in place of attention_efficiency and attention_block: on a CPU a short prompt's
    # attention is mostly its call's own cost, which no share of peak FLOP/s draws, and the FLOPs
    # a kernel computes of a causal mask depend on its tiling (docs/simulator.md). Empty: FLOPs.
    prompt_attention: tuple[tuple[int, float], ...] = ()
    # (pairs, seconds) pairs: the engine's attention for one request's new tokens over a cached
    # prefix no other request of its batch shares, by the (query, key) pairs its call reads (new
    # tokens x (prefix + new tokens)), per layer, query head and unit of head dim (`calibrate`
    # measures it: peaks.measure_extend_attention). Where present it prices such an extend's whole
    # attention in place of prompt_attention and context_attention_efficiency: on a CPU the engine
    # runs it as one masked call over all its keys, its causal half computed in full. Empty: FLOPs.
    extend_attention: tuple[tuple[int, float], ...] = ()

    def roofline(self, compute: float, memory: float, decode: bool) -> float:
        """A forward's time before its fixed costs: a decode step's by memory_compute_norm, any
        other's the larger of the two."""
        p = self.memory_compute_norm
        return max(compute, memory) if p is None or not decode else float((compute**p + memory**p) ** (1 / p))

    # Measured by `calibrate`, not fitted; none on the GPU profiles (their kernels' share is small
    # and in their efficiencies).
    pointwise: PointwiseCosts = PointwiseCosts()

    def measured(self) -> HardwareProfile:
        """What `calibrate` measures of this device, the rest at its defaults: the input of its
        fit (calibrate.fit), which fills the rest in."""
        return HardwareProfile(
            self.name,
            self.peak_flops,
            self.memory_bandwidth,
            self.memory_bytes,
            device_type=self.device_type,
            linear_rates=self.linear_rates,
            pointwise=self.pointwise,
            decode_overlap=self.decode_overlap,
            prompt_attention=self.prompt_attention,
            extend_attention=self.extend_attention,
        )

    def linear_peak(self, width: int) -> float:
        """The FLOP/s of a `width`-wide model's linears: linear_rates interpolated in the log of
        the width, held at their ends; peak_flops without them."""
        rates = self.linear_rates
        if not rates:
            return self.peak_flops
        if width <= rates[0][0]:
            return rates[0][1]
        for (narrow, slow), (wide, fast) in itertools.pairwise(rates):
            if width <= wide:
                share = math.log(width / narrow) / math.log(wide / narrow)
                return slow + share * (fast - slow)
        return rates[-1][1]

    def prompt_attention_s(self, new_tokens: int) -> float:
        """prompt_attention's seconds per layer, query head and unit of head dim for a prompt of
        `new_tokens`; beyond the longest it grows with the square of the length (its pairs)."""
        return _interpolated(self.prompt_attention, new_tokens, beyond_power=2)

    def extend_attention_s(self, pairs: int) -> float:
        """extend_attention's seconds per layer, query head and unit of head dim for an extend
        that reads `pairs` (query, key) pairs; beyond the largest in proportion to them."""
        return _interpolated(self.extend_attention, pairs, beyond_power=1)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> HardwareProfile:
        """A profile from its JSON (save's), its pairs (rates, overlap, attention) made tuples again."""
        pairs = {
            name: tuple((int(size), float(value)) for size, value in fields.get(name, ()))
            for name in ("linear_rates", "decode_overlap", "prompt_attention", "extend_attention")
        }
        pointwise = PointwiseCosts(**fields.get("pointwise", {}))
        return cls(**{**fields, **pairs, "pointwise": pointwise})

    @classmethod
    def load(cls, path: Path) -> HardwareProfile:
        return cls.from_dict(json.loads(path.read_text()))


def _interpolated(table: tuple[tuple[int, float], ...], x: int, beyond_power: float) -> float:
    """A measured (size, seconds) table at `x`: interpolated in the logs of both between its sizes,
    the smallest's value below them (a call's own cost, which no smaller size lowers), and the
    largest's times (x / largest) ** beyond_power above them."""
    if x <= table[0][0]:
        return table[0][1]
    for (small, fast), (large, slow) in itertools.pairwise(table):
        if x <= large:
            share = math.log(x / small) / math.log(large / small)
            return float(fast * (slow / fast) ** share)
    largest, seconds = table[-1]
    return float(seconds * (x / largest) ** beyond_power)


_GB = 1e9
# Published figures: dense BF16 tensor-core FLOP/s (without sparsity) and HBM/GDDR bandwidth.
BUILTIN_PROFILES: dict[str, HardwareProfile] = {
    "H100": HardwareProfile("H100", 989.4e12, 3350 * _GB, 80 * _GB, note="H100 SXM5 80GB spec sheet"),
    "H200": HardwareProfile("H200", 989.4e12, 4800 * _GB, 141 * _GB, note="H200 SXM 141GB spec sheet"),
    "A100": HardwareProfile("A100", 312e12, 2039 * _GB, 80 * _GB, note="A100 SXM4 80GB spec sheet"),
    "L4": HardwareProfile("L4", 121e12, 300 * _GB, 24 * _GB, note="L4 24GB spec sheet"),
}


def load_profile(spec: str) -> HardwareProfile:
    """A built-in profile by name (H100, H200, A100, L4), or a JSON file `calibrate` wrote."""
    if spec.upper() in BUILTIN_PROFILES:
        return BUILTIN_PROFILES[spec.upper()]
    path = Path(spec)
    if not path.is_file():
        names = ", ".join(BUILTIN_PROFILES)
        message = f"hardware {spec!r} is neither a built-in profile ({names}) nor a profile file"
        raise InvalidArgumentError(message)
    return HardwareProfile.load(path)
