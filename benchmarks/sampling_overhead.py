"""Per-step sampling overhead, as a fraction of a decode step, at batch 1, 32 and 128.

Variants: all features off (greedy and temperature/top-p), with penalties (frequency, presence,
repetition over a 256-token history), and with a JSON-schema grammar (bitmask fill + mask).
The decode step time is measured on the same run with the random SmolLM2-shaped model (bf16),
so the ratios hold on whatever machine runs this.

    .venv/bin/python benchmarks/sampling_overhead.py [MODEL_DIR]
    # MODEL_DIR defaults to bench-work/smollm2-135m-random-bf16 (made by `radixserve bench offline`)
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

from radixserve.config.server_args import ServerArgs
from radixserve.layers.sampler import SamplingBatch, sample
from radixserve.protocol.messages import GenerateRequest
from radixserve.protocol.sampling_params import SamplingParams
from radixserve.scheduler.grammar import GrammarBackend, GrammarMatcher
from radixserve.scheduler.process import build_scheduler
from radixserve.scheduler.scheduler import Scheduler

BATCHES = (1, 32, 128)
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "n": {"type": "integer"}, "tags": {"type": "array"}},
    "required": ["name", "n"],
}


def zipf_logits(batch: int, vocab: int) -> torch.Tensor:
    """Logits shaped like a language model's: probability ~ 1 / rank, ranks shuffled per row.
    (Random-weight models give nearly flat distributions, where top-p must sort the whole vocab.)"""
    ranks = torch.stack([torch.randperm(vocab) for _ in range(batch)]).float() + 1.0
    return -torch.log(ranks) * 1.2


def timed(fn: object, repeats: int = 20) -> float:
    """Median seconds of fn() over repeats, after one warmup."""
    assert callable(fn)
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_plain(
    params: list[SamplingParams], logits: torch.Tensor, history: list[tuple[list[int], list[int]]]
) -> None:
    batch, vocab = logits.shape
    sampling = SamplingBatch.build(params, [None] * batch, vocab, torch.device("cpu"), histories=history)
    sample(logits, sampling)


def run_grammar(backend: GrammarBackend, matchers: list[GrammarMatcher | None], logits: torch.Tensor) -> None:
    batch, vocab = logits.shape
    allowed = backend.bitmask(matchers, torch.device("cpu"))
    greedy = [SamplingParams(temperature=0.0)] * batch
    sample(logits, SamplingBatch.build(greedy, [None] * batch, vocab, torch.device("cpu"), allowed=allowed))


def decode_step_seconds(scheduler: Scheduler, batch: int) -> float:
    """Median time of a decode step (forward + greedy sampling + bookkeeping) with `batch` requests."""
    for i in range(batch):
        params = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 64}
        scheduler.handle(
            GenerateRequest(f"b{batch}-{i}", [100 + i, 200, 300, 400], SamplingParams.from_dict(params))
        )
    scheduler.step()  # the prefill
    times = []
    for _ in range(20):
        start = time.perf_counter()
        scheduler.step()
        times.append(time.perf_counter() - start)
    scheduler.abort(None, abort_all=True)
    return statistics.median(times)


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else str(Path("bench-work/smollm2-135m-random-bf16"))
    scheduler = build_scheduler(
        ServerArgs(model_path=model, dtype="bfloat16", max_total_tokens=40000, log_level="warning")
    )
    vocab = scheduler.config.vocab_size
    backend = GrammarBackend(scheduler._get_tokenizer(), vocab)
    grammar = backend.compile(("json_schema", json.dumps(SCHEMA))).result().grammar
    rows = []
    for batch in BATCHES:
        step = decode_step_seconds(scheduler, batch)
        logits = zipf_logits(batch, vocab)
        history = [(list(range(100, 356)), list(range(400, 656)))] * batch
        variants = {
            "greedy": [SamplingParams(temperature=0.0)] * batch,
            "temperature+top_p": [SamplingParams(temperature=0.8, top_p=0.9)] * batch,
            "penalties": [SamplingParams(frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.1)]
            * batch,
        }
        result = {"batch": batch, "decode_step_ms": round(step * 1e3, 2)}
        for name, params in variants.items():
            result[name] = round(timed(partial(run_plain, params, logits, history)) / step, 4)
        matchers: list[GrammarMatcher | None] = [
            backend.matcher(grammar, "json_schema") for _ in range(batch)
        ]
        result["json_grammar"] = round(timed(partial(run_grammar, backend, matchers, logits)) / step, 4)
        rows.append(result)
        print(json.dumps(result), flush=True)
    print("\nsampling time as a fraction of one decode step (bf16 random SmolLM2-135M shape):")
    print(f"{'batch':>5} {'step ms':>8} " + " ".join(f"{k:>18}" for k in list(rows[0])[2:]))
    for r in rows:
        print(f"{r['batch']:>5} {r['decode_step_ms']:>8} " + " ".join(f"{r[k]:>18.1%}" for k in list(r)[2:]))


if __name__ == "__main__":
    main()
