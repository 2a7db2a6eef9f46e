"""The executor `radixserve simulate` drives the real Scheduler with: it runs no model, it charges
each forward the cost model's time on a virtual clock. Sampled tokens are all 0 (requests run
with ignore_eos and their trace's output length), so the scheduler sees what it would see of a
model but the tokens' values; only what batching, caching and retraction need is real."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any

import torch

from radixserve.attention.common import decode_shared_prefix, shared_prefix_groups
from radixserve.executor.base import ExecutorInfo
from radixserve.forward.batch import ForwardBatch, ForwardMode
from radixserve.layers.sampler import SamplingBatch
from radixserve.models.config import ModelConfig
from radixserve_tools.simulator.cost_model import (
    ForwardShape,
    ModelShape,
    SharedPrefix,
    forward_seconds,
    wake_seconds,
)
from radixserve_tools.simulator.hardware import HardwareProfile

# The vocabulary the scheduler is shown: logits are allocated per sampled row every step, and
# only their shape matters here, so a small one keeps the simulation fast. Trace token ids
# stay below it.
SIM_VOCAB = 4096
SIM_HIDDEN = 8


@dataclass
class VirtualClock:
    now: float = 0.0

    def advance_to(self, t: float) -> None:
        self.now = max(self.now, t)


@dataclass
class ForwardRecord:
    start: float
    seconds: float
    mode: str
    shape: ForwardShape
    # How long the device had been idle before it (since the previous forward, or the clock's 0).
    idle_s: float = 0.0

    @property
    def tokens(self) -> int:
        return sum(self.shape.q_lens)

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> ForwardRecord:
        """A record from its JSON (dataclasses.asdict's), as a validation saves a replay's."""
        shape = dict(fields["shape"])
        shape["shared_prefixes"] = tuple(SharedPrefix(**p) for p in shape.get("shared_prefixes", ()))
        shape["cascade_requests"] = tuple(shape.get("cascade_requests", ()))
        return cls(**{**fields, "shape": ForwardShape(**shape)})


@dataclass
class CostModelExecutor:
    config: ModelConfig
    max_total_tokens: int
    profile: HardwareProfile | None  # None: every forward costs nothing (the scheduler's own cost)
    clock: VirtualClock = field(default_factory=VirtualClock)
    context_len: int | None = None
    records: list[ForwardRecord] = field(default_factory=list)
    # Whether forwards record the K/V reads a cascade backend shares (None: when the profile's
    # attention is a cascade). Finding shared prefixes costs host time, which a zero-cost run that
    # measures the scheduler's own cost must not count.
    count_shared_reads: bool | None = None
    # Seeds the draws of each forward's time around the roofline's (the profile's forward_noise).
    seed: int = 0
    # When the last forward ended: the device is idle from then until the next one starts.
    _last_end: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        if self.count_shared_reads is None:
            self.count_shared_reads = self.profile is not None and self.profile.cascade_attention
        self.shape = ModelShape.of(self.config)
        self._noise = random.Random(self.seed)
        self.sim_config = dataclasses.replace(self.config, vocab_size=SIM_VOCAB, eos_token_ids=[])

    @property
    def info(self) -> ExecutorInfo:
        context = self.context_len or self.config.max_position_embeddings
        device = torch.device("cpu")
        return ExecutorInfo(self.sim_config, context, self.max_total_tokens, torch.bfloat16, device, False)

    def forward(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        fwd = forward_shape(batch, bool(self.count_shared_reads))
        idle = max(0.0, self.clock.now - self._last_end)
        seconds = 0.0
        if self.profile is not None:
            seconds = forward_seconds(self.shape, self.profile, fwd) * self._spread()
            seconds += wake_seconds(self.profile, idle)
        self.records.append(ForwardRecord(self.clock.now, seconds, batch.mode.name, fwd, idle))
        self.clock.now += seconds
        self._last_end = self.clock.now
        rows = fwd.sampled_rows
        extra = 0 if batch.hidden_rows is None else len(batch.hidden_rows)
        # Never read: sample() answers without them (uninitialized, so they cost no fill).
        return torch.empty(rows, SIM_VOCAB), torch.zeros(rows + extra, SIM_HIDDEN)

    def _spread(self) -> float:
        """A lognormal factor of mean 1 (a calibrated profile's times are means: its fit is on
        runs of many forwards), or 1 where the profile has no noise."""
        sigma = 0.0 if self.profile is None else self.profile.forward_noise
        return self._noise.lognormvariate(-sigma * sigma / 2, sigma) if sigma else 1.0

    def sample(self, logits: torch.Tensor, sampling: SamplingBatch) -> torch.Tensor:
        return torch.zeros(logits.shape[0], dtype=torch.int64)

    def idle(self) -> None:
        pass

    def close(self) -> None:
        pass

    def describe(self) -> dict[str, Any]:
        return {"executor": "cost model", "hardware": None if self.profile is None else self.profile.name}

    def stats(self) -> dict[str, Any]:
        return {}


def forward_shape(batch: ForwardBatch, count_shared_reads: bool) -> ForwardShape:
    """What the cost model is given of a batch: each request's new and cached tokens, the rows it
    samples, and with count_shared_reads the cached prefixes its requests share."""
    logprob_rows = 0 if batch.logprob_rows is None else len(batch.logprob_rows)
    sampled = len(batch.sample_rows) + logprob_rows
    if batch.mode is ForwardMode.DECODE:
        assert batch.decode is not None
        seq_lens = batch.decode.seq_lens.tolist()
        prefix = decode_shared_prefix(batch.decode) if count_shared_reads else None
        rows = len(seq_lens)
        one = () if prefix is None else (SharedPrefix(len(prefix), rows, rows),)
        return ForwardShape([1] * rows, [n - 1 for n in seq_lens], sampled, True, one)
    assert batch.extend is not None
    segments = batch.extend
    # The same groups the CPU backend's extend cascade finds (attention/common.py).
    groups = shared_prefix_groups(segments) if count_shared_reads else []
    shared = tuple(
        SharedPrefix(segments[g[0]].prefix_len, len(g), sum(segments[i].q_len for i in g)) for g in groups
    )
    q_lens, prefix_lens = [s.q_len for s in segments], [s.prefix_len for s in segments]
    cascaded = tuple(sorted(i for g in groups for i in g))
    return ForwardShape(q_lens, prefix_lens, sampled, False, shared, cascaded)
