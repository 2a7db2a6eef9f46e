"""`radixserve bench speculative`: decode speed with NGRAM speculation on and off.

Workloads:
- copy: the real SmolLM2-135M-Instruct (the packaged GGUF) asked, through its chat template, to
  repeat, reformat or lightly edit a given passage or code snippet (passages below, written for
  this benchmark), greedy, up to 128 output tokens. Measured one request at a time (single stream)
  and eight at once (batch 8).
- W3 (bench/workloads.py: random tokens, one stream, where nothing can be copied), on the
  random-weight SmolLM2-135M: the cost of speculation when it cannot help.

Decode tok/s excludes the prefill: each run is timed twice on a flushed cache, once for one output
token (the prefill) and once for the whole output, and decode tok/s = (tokens - 1) / (difference).
Both settings run in the same process on the same weights, so their ratio is what to read.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from radixserve.bench.model import ensure_random_smollm2
from radixserve.bench.workloads import make_workload

Log = Callable[[str], None]

MAX_NEW_TOKENS = 128
BATCH = 8

PASSAGES = [
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, "
    "polished the great lens until it shone, and wrote the weather in a small leather book. Ships "
    "passing the rocky point never saw him, only the steady beam that swept across the dark water.",
    "To make the bread, mix the flour, salt and yeast in a large bowl. Add warm water slowly and "
    "stir until a soft dough forms. Knead it for ten minutes, cover it with a cloth, and leave it "
    "somewhere warm for an hour. Shape the loaf, let it rise again, then bake it until golden.",
    "def moving_average(values, window):\n    result = []\n    total = 0.0\n    for index, value in "
    "enumerate(values):\n        total += value\n        if index >= window:\n            total -= "
    "values[index - window]\n        if index >= window - 1:\n            result.append(total / window)\n"
    "    return result\n",
    "Meeting notes: the team agreed to move the release to the second week of March. Testing will "
    "finish by the end of February, the documentation will be reviewed by Anna, and Tom will prepare "
    "the migration guide. The next meeting is on Thursday at ten in the small conference room.",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        if not self.items:\n            "
    "raise IndexError('pop from an empty stack')\n        return self.items.pop()\n\n    def "
    "peek(self):\n        return self.items[-1]\n",
    "Our garden changes with every season. In spring the tulips open along the fence, in summer the "
    "tomatoes climb their stakes and the bees visit the lavender, in autumn the apple tree drops its "
    "fruit on the lawn, and in winter the bare branches hold small piles of snow.",
    "The museum opens at nine in the morning and closes at six in the evening, except on Mondays. "
    "Tickets cost twelve dollars for adults and six dollars for children. Guided tours start every "
    "hour from the main hall, and the cafe on the second floor serves lunch until three.",
    "SELECT customers.name, COUNT(orders.id) AS order_count\nFROM customers\nJOIN orders ON "
    "orders.customer_id = customers.id\nWHERE orders.created_at >= '2024-01-01'\nGROUP BY "
    "customers.name\nHAVING COUNT(orders.id) > 3\nORDER BY order_count DESC;\n",
]

INSTRUCTIONS = [
    "Repeat the following text exactly, word for word, and add nothing else:\n\n{}",
    "Copy the following passage without changing anything:\n\n{}",
    "Here is a text. Write it out again exactly as it is:\n\n{}",
    "Reproduce this exactly:\n\n{}",
]


def copy_messages() -> list[list[dict[str, str]]]:
    """One chat per passage, each with its own instruction."""
    return [
        [{"role": "user", "content": INSTRUCTIONS[i % len(INSTRUCTIONS)].format(p)}]
        for i, p in enumerate(PASSAGES)
    ]


@dataclass(frozen=True)
class DecodeRun:
    tokens: int  # output tokens of every request
    decode_s: float  # seconds of decoding (the run less its prefill)

    @property
    def tok_per_s(self) -> float:
        return self.tokens / self.decode_s if self.decode_s > 0 else 0.0


def _timed(engine: Any, prompts: list[list[int]], max_new: int, ignore_eos: bool) -> tuple[float, int]:
    engine.flush_cache()
    params = {"temperature": 0.0, "max_new_tokens": max_new, "ignore_eos": ignore_eos}
    started = time.perf_counter()
    results = engine.generate(input_ids=prompts, sampling_params=params)
    elapsed = time.perf_counter() - started
    return elapsed, sum(len(r["output_ids"]) for r in results)


def measure(engine: Any, prompts: list[list[int]], ignore_eos: bool, repeats: int) -> DecodeRun:
    """Median decode time of the prompts run together (one call), over repeats."""
    prefill = statistics.median(_timed(engine, prompts, 1, ignore_eos)[0] for _ in range(repeats))
    runs = [_timed(engine, prompts, MAX_NEW_TOKENS, ignore_eos) for _ in range(repeats)]
    whole = statistics.median(t for t, _ in runs)
    tokens = runs[0][1]
    # The first token of every request comes with the prefill.
    return DecodeRun(tokens - len(prompts), max(whole - prefill, 1e-9))


def _engine(model_path: str | None, dtype: str, speculative: bool, extra: dict[str, Any]) -> Any:
    from radixserve.runtime.engine import Engine

    kwargs: dict[str, Any] = {"dtype": dtype, "log_level": "warning", **extra}
    if speculative:
        kwargs["speculative_algorithm"] = "NGRAM"
    return Engine(model_path=model_path, **kwargs)


def _accept_stats(engine: Any) -> dict[str, float]:
    stats = engine.get_stats()
    return {"accept_length": stats["avg_spec_accept_length"], "accept_rate": stats["spec_accept_rate"]}


def run_speculative_bench(
    dtype: str = "bfloat16", repeats: int = 3, work_dir: Path = Path("bench-work"), log: Log = print,
    engine_args: dict[str, Any] | None = None,
) -> dict[str, Any]:  # fmt: skip
    extra = dict(engine_args or {})
    rows: list[dict[str, Any]] = []
    random_model = str(ensure_random_smollm2(work_dir, dtype))
    w3 = make_workload("W3").prompts
    for speculative in (False, True):
        label = "NGRAM" if speculative else "off"
        engine = _engine(None, dtype, speculative, extra)
        try:
            chats = [engine.tokenize_chat(m) for m in copy_messages()]
            single = [measure(engine, [p], ignore_eos=False, repeats=repeats) for p in chats]
            tokens, seconds = sum(r.tokens for r in single), sum(r.decode_s for r in single)
            batch = measure(engine, chats[:BATCH], ignore_eos=False, repeats=repeats)
            stats = _accept_stats(engine) if speculative else {}
        finally:
            engine.shutdown()
        rows.append({"workload": "copy", "mode": "single stream", "speculative": label,
                     "decode_tok_s": tokens / seconds, "tokens": tokens, **stats})  # fmt: skip
        rows.append({"workload": "copy", "mode": f"batch {BATCH}", "speculative": label,
                     "decode_tok_s": batch.tok_per_s, "tokens": batch.tokens, **stats})  # fmt: skip
        log(
            f"copy, NGRAM {label}: single {rows[-2]['decode_tok_s']:.1f} tok/s, "
            f"batch {batch.tok_per_s:.1f} tok/s"
        )
        engine = _engine(random_model, dtype, speculative, extra)
        try:
            run = measure(engine, w3, ignore_eos=True, repeats=repeats)
            stats = _accept_stats(engine) if speculative else {}
        finally:
            engine.shutdown()
        rows.append({"workload": "W3 (random)", "mode": "single stream", "speculative": label,
                     "decode_tok_s": run.tok_per_s, "tokens": run.tokens, **stats})  # fmt: skip
        log(f"W3, NGRAM {label}: {run.tok_per_s:.1f} tok/s")
    return {"dtype": dtype, "repeats": repeats, "rows": rows}


def format_table(report: dict[str, Any]) -> str:
    lines = [
        "| workload | mode | NGRAM | decode tok/s | vs off | accept length |",
        "|---|---|---|---|---|---|",
    ]
    base = {
        (r["workload"], r["mode"]): r["decode_tok_s"] for r in report["rows"] if r["speculative"] == "off"
    }
    for row in report["rows"]:
        ratio = row["decode_tok_s"] / base[(row["workload"], row["mode"])]
        length = f"{row['accept_length']:.2f}" if "accept_length" in row else "-"
        lines.append(
            f"| {row['workload']} | {row['mode']} | {row['speculative']} | {row['decode_tok_s']:.1f} | "
            f"{ratio:.2f}x | {length} |"
        )
    return "\n".join(lines)
