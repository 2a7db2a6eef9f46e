"""Deterministic token-id workloads, defined exactly as the peers' `workloads.py`.

W1: 32 requests x 256 random prompt tokens, 64 output tokens each, submitted at once.
W2: 32 requests sharing a 512-token prefix + 32 unique tokens, 32 output tokens each.
W3: 1 request, 128 prompt tokens, 128 output tokens.

At scale 1.0 and full vocabulary the prompts are identical to the peers' (same seeds, same
draw order), so throughput figures are comparable with numbers their scripts produce.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

WORKLOAD_NAMES: tuple[str, ...] = ("W1", "W2", "W3")

# Ids below 100 hold the special tokens of most vocabularies; 49000 stays inside SmolLM2's 49152.
TOKEN_LO = 100
TOKEN_HI = 49000

_SEEDS: dict[str, int] = {"W1": 1, "W2": 2, "W3": 3}


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    max_new_tokens: int

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def in_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def out_tokens(self) -> int:
        return self.num_requests * self.max_new_tokens

    def kv_tokens_needed(self) -> int:
        """KV slots to hold every request at once with no prefix sharing (an upper bound)."""
        return self.in_tokens + self.out_tokens


def _scaled(n: int, scale: float) -> int:
    # Floor keeps scale 0.1 at "3 requests x 25 tokens"; never drop to zero.
    return max(1, int(n * scale))


def make_workload(name: str, scale: float = 1.0, vocab_limit: int | None = None) -> Workload:
    """Build workload `name`. `scale` in (0, 1] shrinks request counts and lengths for smoke
    runs; `vocab_limit` caps token ids for models with a vocabulary smaller than 49000."""
    if name not in _SEEDS:
        raise ValueError(f"unknown workload {name!r}; expected one of {', '.join(WORKLOAD_NAMES)}")
    if not 0.0 < scale <= 1.0:
        raise ValueError(f"scale must be in (0, 1], got {scale}")
    hi = TOKEN_HI if vocab_limit is None else min(TOKEN_HI, vocab_limit)
    # Tiny test vocabularies (~512) are below TOKEN_LO's intent; keep a sane range anyway.
    lo = TOKEN_LO if hi > 2 * TOKEN_LO else max(1, hi // 4)
    if hi - lo < 2:
        raise ValueError(f"vocab_limit {vocab_limit} leaves no room for random token ids")
    rng = random.Random(_SEEDS[name])

    def rnd(n: int) -> list[int]:
        return [rng.randrange(lo, hi) for _ in range(n)]

    def s(n: int) -> int:
        return _scaled(n, scale)

    if name == "W1":
        return Workload(name, [rnd(s(256)) for _ in range(s(32))], s(64))
    if name == "W2":
        prefix = rnd(s(512))
        return Workload(name, [prefix + rnd(s(32)) for _ in range(s(32))], s(32))
    return Workload(name, [rnd(s(128)) for _ in range(s(1))], s(128))


def summarize(workload: Workload, seconds: float, out_tokens: int | None = None) -> dict[str, Any]:
    """Throughput of one timed run, with the peers' field names and rounding."""
    n_in = workload.in_tokens
    n_out = workload.out_tokens if out_tokens is None else out_tokens
    return {
        "workload": workload.name,
        "seconds": round(seconds, 3),
        "in_tokens": n_in,
        "out_tokens": n_out,
        "out_tok_s": round(n_out / seconds, 2),
        "total_tok_s": round((n_in + n_out) / seconds, 2),
    }


def parse_workload_names(spec: str) -> list[str]:
    names = [n.strip().upper() for n in spec.split(",") if n.strip()]
    bad = [n for n in names if n not in _SEEDS]
    if bad or not names:
        raise ValueError(f"workloads must be a comma list of {', '.join(WORKLOAD_NAMES)}, got {spec!r}")
    return names


@dataclass
class EngineRun:
    """One timed run of a workload through an Engine, with its stats before and after."""

    seconds: float
    before: dict[str, Any]
    after: dict[str, Any]

    def delta(self, stat: str) -> float:
        return float(self.after[stat] - self.before[stat])


def time_engine_runs(
    engine: Any, workload: Workload, repeats: int, lora_path: list[str | None] | None = None
) -> list[EngineRun]:
    """Greedy runs of the workload through an Engine: one short warm-up on the prompts' first 16
    tokens, then `repeats` timed runs, each on a cold prefix cache. lora_path: each prompt's LoRA
    adapter (None: the base model's)."""
    params = {"temperature": 0.0, "max_new_tokens": workload.max_new_tokens, "ignore_eos": True}
    warm_up = {**params, "max_new_tokens": 2}
    engine.generate(
        input_ids=[p[:16] for p in workload.prompts], sampling_params=warm_up, lora_path=lora_path
    )
    runs = []
    for _ in range(repeats):
        engine.flush_cache()
        before = engine.get_stats()
        start = time.perf_counter()
        engine.generate(input_ids=workload.prompts, sampling_params=params, lora_path=lora_path)
        seconds = time.perf_counter() - start
        runs.append(EngineRun(seconds, before, engine.get_stats()))
    return runs
