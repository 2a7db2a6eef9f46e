"""`radixserve bench speculative`: decode speed with NGRAM speculation on and off, and with a
STANDALONE draft model when one is given (--draft-model-path, or --draft-early-exit N: the
packaged model's first N layers, the only smaller model of its tokenizer available offline).

Workloads:
- copy: the real SmolLM2-135M-Instruct (the packaged GGUF) asked, through its chat template, to
  repeat, reformat or lightly edit a given passage or code snippet (passages below, written for
  this benchmark), greedy, up to 128 output tokens. Measured one request at a time (single stream)
  and eight at once (batch 8).
- W3 (bench/workloads.py: random tokens, one stream, where nothing can be copied), on the
  random-weight SmolLM2-135M: the cost of speculation when it cannot help.

Decode tok/s excludes the prefill: each run is timed twice on a flushed cache (which empties the
n-gram index too, so drafts come from the request's own text), once for one output token (the
prefill) and once for the whole output, and decode tok/s = (tokens - 1) / (difference). Both
settings run side by side on the same weights, taking turns pass by pass, so their ratio is what
to read. The accept length is each speculating engine's since startup.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from radixserve_tools.bench.model import ensure_random_smollm2
from radixserve_tools.bench.workloads import make_workload

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


def measure(engine: Any, groups: list[list[list[int]]], ignore_eos: bool) -> DecodeRun:
    """One timed pass: each group of prompts run together (one call), its decode time the
    whole run's less its prefill's; the groups' tokens and decode times summed."""
    tokens, seconds = 0, 0.0
    for prompts in groups:
        prefill, _ = _timed(engine, prompts, 1, ignore_eos)
        whole, produced = _timed(engine, prompts, MAX_NEW_TOKENS, ignore_eos)
        # The first token of every request comes with the prefill.
        tokens += produced - len(prompts)
        seconds += max(whole - prefill, 1e-9)
    return DecodeRun(tokens, seconds)


def compare(
    engines: dict[str, Any], groups: list[list[list[int]]], ignore_eos: bool, repeats: int
) -> dict[str, DecodeRun]:
    """Per setting, the median pass; the settings take turns pass by pass, so that a machine
    whose speed drifts during the run affects them alike."""
    passes: dict[str, list[DecodeRun]] = {label: [] for label in engines}
    for _ in range(repeats):
        for label, engine in engines.items():
            passes[label].append(measure(engine, groups, ignore_eos))
    return {label: sorted(runs, key=lambda r: r.tok_per_s)[len(runs) // 2] for label, runs in passes.items()}


def _engine(model_path: str | None, dtype: str, speculative: dict[str, Any], extra: dict[str, Any]) -> Any:
    from radixserve.runtime.engine import Engine

    return Engine(model_path=model_path, dtype=dtype, log_level="warning", **speculative, **extra)


def _accept_stats(engine: Any) -> dict[str, float]:
    stats = engine.get_stats()
    return {"accept_length": stats["avg_spec_accept_length"], "accept_rate": stats["spec_accept_rate"]}


def settings(draft_model_path: str | None, num_steps: int) -> dict[str, dict[str, Any]]:
    """Each compared setting's speculative engine arguments, by label."""
    found: dict[str, dict[str, Any]] = {"off": {}, "NGRAM": {"speculative_algorithm": "NGRAM"}}
    if draft_model_path is not None:
        found["STANDALONE"] = {
            "speculative_algorithm": "STANDALONE",
            "speculative_draft_model_path": draft_model_path,
            "speculative_num_steps": num_steps,
        }
    return found


def run_speculative_bench(
    dtype: str = "bfloat16", repeats: int = 3, work_dir: Path = Path("bench-work"), log: Log = print,
    engine_args: dict[str, Any] | None = None, draft_model_path: str | None = None, num_steps: int = 4,
) -> dict[str, Any]:  # fmt: skip
    extra = dict(engine_args or {})
    rows: list[dict[str, Any]] = []
    random_model = str(ensure_random_smollm2(work_dir, dtype))
    compared = settings(draft_model_path, num_steps)
    for model, workload in ((None, "copy"), (random_model, "W3 (random)")):
        engines = {label: _engine(model, dtype, spec, extra) for label, spec in compared.items()}
        try:
            if workload == "copy":
                chats = [engines["off"].tokenize_chat(m) for m in copy_messages()]
                cases = [
                    ("single stream", [[p] for p in chats], False),
                    (f"batch {BATCH}", [chats[:BATCH]], False),
                ]
            else:
                cases = [("single stream", [make_workload("W3").prompts], True)]
            for mode, groups, ignore_eos in cases:
                for label, run in compare(engines, groups, ignore_eos, repeats).items():
                    stats = _accept_stats(engines[label]) if label != "off" else {}
                    rows.append({"workload": workload, "mode": mode, "speculative": label,
                                 "decode_tok_s": run.tok_per_s, "tokens": run.tokens, **stats})  # fmt: skip
                    log(f"{workload}, {mode}, {label}: {run.tok_per_s:.1f} decode tok/s")
        finally:
            for engine in engines.values():
                engine.shutdown()
    return {"dtype": dtype, "repeats": repeats, "draft_model_path": draft_model_path, "rows": rows}


def format_table(report: dict[str, Any]) -> str:
    lines = [
        "| workload | mode | speculation | decode tok/s | vs off | accept length |",
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
