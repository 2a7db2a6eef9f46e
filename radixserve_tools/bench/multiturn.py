"""`radixserve bench multiturn`: a multi-turn chat workload whose conversations together outgrow
the device KV pool, with and without the storage tier (--enable-hierarchical-cache
--hicache-storage-backend file), and after a restart on the storage tier's directory.

Workload: C conversations x T turns on the packaged SmolLM2-135M-Instruct. A turn sends the
conversation so far (its earlier turns and replies) plus a new user message of U random tokens,
and the model replies with R tokens (greedy, ignore_eos). With a context of X tokens, each
conversation's first message starts with X random tokens of its own (a document asked about, or
an agent's instructions and tool results), as in document Q&A and agent loops. The turns go
round by round (every conversation's turn 1, then every conversation's turn 2, ...),
`concurrency` requests at a time, so by the time a conversation returns, the others have pushed it
out of a pool sized to hold about `pool_conversations` of them. Reported per setting: output
tok/s over the whole run, TTFT p50 and p99 (the time to the first streamed token), the prompt
tokens served from cache, and what the storage tier loaded.

Settings, each a fresh engine (taking turns is not possible here: "storage, restarted" reads what
"storage" wrote): "off" (the radix cache alone), "host" (L2: the host pool beside a GPU's KV pool,
no file tier), "storage" (the file tier in a fresh directory), "storage, restarted" (a new engine
on that directory, running the same conversations again from their first turn).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Log = Callable[[str], None]
# The user messages' random token ids are below this (the packaged model's vocabulary is 49,152).
SMOLLM2_TOKEN_IDS = 49_000


@dataclass(frozen=True)
class MultiTurnWorkload:
    conversations: int = 64
    turns: int = 6
    user_tokens: int = 64
    reply_tokens: int = 32
    concurrency: int = 4
    pool_conversations: int = 8
    context_tokens: int = 0
    seed: int = 0

    @property
    def conversation_tokens(self) -> int:
        return self.context_tokens + self.turns * (self.user_tokens + self.reply_tokens)

    def messages(self, vocab_size: int) -> list[list[list[int]]]:
        rng = random.Random(self.seed)
        conversations = []
        for _ in range(self.conversations):

            def tokens(n: int) -> list[int]:
                return [rng.randrange(100, vocab_size) for _ in range(n)]

            turns = [tokens(self.user_tokens) for _ in range(self.turns)]
            turns[0] = tokens(self.context_tokens) + turns[0]
            conversations.append(turns)
        return conversations


@dataclass
class RunResult:
    seconds: float
    output_tokens: int
    ttft_s: list[float]
    cached_tokens: int
    prompt_tokens: int
    stats: dict[str, Any]

    def row(self, label: str) -> dict[str, Any]:
        ttft = sorted(self.ttft_s)
        return {
            "setting": label,
            "output_tok_s": self.output_tokens / self.seconds,
            "ttft_p50_ms": statistics.median(ttft) * 1e3,
            "ttft_p99_ms": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))] * 1e3,
            "cached_share": self.cached_tokens / max(1, self.prompt_tokens),
            "storage_hit_tokens": self.stats.get("hicache_storage_hit_tokens", 0),
            "host_pages_loaded": self.stats.get("hicache_host_pages_loaded", 0),
            "storage_load_s": self.stats.get("hicache_storage_load_seconds", 0.0),
            "seconds": self.seconds,
            "ttft_ms": [t * 1e3 for t in self.ttft_s],  # every request's, for --plot
        }


async def run_turns(engine: Any, workload: MultiTurnWorkload, messages: list[list[list[int]]]) -> RunResult:
    """The conversations round by round, `workload.concurrency` turns in flight, on one engine."""
    histories: list[list[int]] = [[] for _ in messages]
    ttft: list[float] = []
    totals = {"output": 0, "cached": 0, "prompt": 0}
    gate = asyncio.Semaphore(workload.concurrency)
    params = {"temperature": 0.0, "max_new_tokens": workload.reply_tokens, "ignore_eos": True}

    async def turn(conversation: int, index: int) -> None:
        async with gate:
            prompt = histories[conversation] + messages[conversation][index]
            started, first, last = time.perf_counter(), None, {}
            async for chunk in engine.async_stream(None, params, prompt):
                if first is None and chunk["output_ids"]:
                    first = time.perf_counter() - started
                last = chunk
            ttft.append(first if first is not None else time.perf_counter() - started)
            histories[conversation] = prompt + list(last["output_ids"])
            totals["output"] += len(last["output_ids"])
            totals["cached"] += last["meta_info"]["cached_tokens"]
            totals["prompt"] += len(prompt)

    started = time.perf_counter()
    for index in range(workload.turns):
        await asyncio.gather(*(turn(c, index) for c in range(len(messages))))
    seconds = time.perf_counter() - started
    return RunResult(seconds, totals["output"], ttft, totals["cached"], totals["prompt"], engine.get_stats())


# Each a fresh engine: the radix cache alone; L2, the host pool beside a GPU's pool (on a CPU only
# with RADIXSERVE_HICACHE_HOST_POOL=1); the file tier in a fresh directory; a new engine on that
# directory (it reads what "storage" wrote, so it runs after it).
SETTINGS = ("off", "host", "storage", "storage, restarted")
DEFAULT_SETTINGS = ("off", "storage", "storage, restarted")


def run_multiturn_bench(
    workload: MultiTurnWorkload, dtype: str = "bfloat16", storage_root: Path | None = None,
    log: Log = print, engine_args: dict[str, Any] | None = None,
    settings: tuple[str, ...] = DEFAULT_SETTINGS, model_path: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    from radixserve.runtime.engine import Engine

    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        raise ValueError(f"unknown settings {unknown}: choose from {', '.join(SETTINGS)}")
    if "storage, restarted" in settings and "storage" not in settings:
        raise ValueError('"storage, restarted" reads what "storage" wrote: run both')
    directory = Path(storage_root or tempfile.mkdtemp(prefix="radixserve-hicache-bench-"))
    pool = workload.pool_conversations * workload.conversation_tokens
    base: dict[str, Any] = {
        "dtype": dtype,
        "log_level": "warning",
        "max_total_tokens": pool,
        **(engine_args or {}),
    }
    storage: dict[str, Any] = {
        "enable_hierarchical_cache": True,
        "hicache_storage_backend": "file",
        "hicache_storage_dir": str(directory),
    }
    flags: dict[str, dict[str, Any]] = {
        "off": {},
        "host": {"enable_hierarchical_cache": True},
        "storage": storage,
        "storage, restarted": storage,
    }
    rows = []
    for label in sorted(settings, key=SETTINGS.index):
        engine = Engine(model_path=model_path, **base, **flags[label])
        try:
            if label == "storage":
                engine.clear_hicache_storage_backend()  # a directory from an earlier run starts empty
            messages = workload.messages(min(SMOLLM2_TOKEN_IDS, engine.vocab_size))
            result = asyncio.run(run_turns(engine, workload, messages))
            engine.check_kv_invariant()  # every tier idle: nothing leaked, nothing counted twice
            rows.append(result.row(label))
            row = rows[-1]
            log(f"{label}: {row['output_tok_s']:.1f} output tok/s, TTFT p50 {row['ttft_p50_ms']:.0f} ms")
        finally:
            engine.shutdown()
    return {"workload": workload.__dict__, "dtype": dtype, "pool_tokens": pool, "rows": rows}


def format_table(report: dict[str, Any]) -> str:
    lines = [
        "| setting | output tok/s | TTFT p50 ms | TTFT p99 ms | prompt share cached | storage hit tokens "
        "| L2 pages loaded |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['setting']} | {r['output_tok_s']:.1f} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | "
            f"{r['cached_share']:.2f} | {r['storage_hit_tokens']} | {r.get('host_pages_loaded', 0)} |"
        )
    return "\n".join(lines)
