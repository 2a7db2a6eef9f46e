"""Loglikelihood accuracy of a served GGUF against its fp32 dequantized reference, as an lm-eval
loglikelihood task measures it: for each (context, continuation) pair, the sum of the
continuation's token log-probabilities, read from the prefill's prompt logprobs.

    .venv/bin/python benchmarks/quantized_accuracy.py [--model-path FILE.gguf] [--pairs 150]

The pairs are cut from the project's own docs (offline, fixed): a context of 48 tokens, then a
continuation of 8 to 24 tokens. Each configuration is compared with `--quantization none --dtype
float32` (the oracle: transformers' dequantization, tests/engine/test_smollm2_gguf.py): max and mean
|delta loglikelihood|, and how many pairs keep the same greedy token at every continuation position
(argmax agreement).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from radixserve.config.server_args import ServerArgs
from radixserve.kernels.quant_ops import ACTIVATIONS_ENV
from radixserve.models.source import resolve_model_source
from radixserve.models.tokenizer import load_tokenizer
from radixserve.protocol.messages import GenerateRequest
from radixserve.scheduler.process import build_scheduler

# name -> (ServerArgs fields, RADIXSERVE_QUANT_ACTIVATIONS)
CONFIGS: dict[str, tuple[dict[str, str | None], str]] = {
    "dense bf16 (--quantization none --dtype bfloat16)": (
        {"quantization": "none", "dtype": "bfloat16"},
        "float",
    ),
    "quantized, float kernel, fp32 activations": ({"quantization": None, "dtype": "float32"}, "float"),
    "quantized, float kernel, bf16 activations": ({"quantization": None, "dtype": "bfloat16"}, "float"),
    "quantized, int8 kernel, fp32 activations": ({"quantization": None, "dtype": "float32"}, "int8"),
    "quantized, int8 kernel, bf16 activations": ({"quantization": None, "dtype": "bfloat16"}, "int8"),
}


def make_pairs(tokenizer: object, count: int) -> list[tuple[list[int], int]]:
    """(token ids, continuation length) pairs from the docs' text, deterministic."""
    docs = sorted((Path(__file__).parent.parent / "docs").glob("*.md"))
    ids: list[int] = []
    for doc in docs:
        ids += tokenizer(doc.read_text()).input_ids  # type: ignore[operator]
    pairs = []
    at = 0
    for index in range(count):
        length = 8 + index % 17
        pairs.append((ids[at : at + 48 + length], length))
        at += 48 + length + 7
    return pairs


def loglikelihoods(
    args: ServerArgs, pairs: list[tuple[list[int], int]]
) -> tuple[list[float], list[list[int]]]:
    """Per pair: the continuation's summed log-probability and its greedy tokens."""
    scheduler = build_scheduler(args)
    sums, greedy = [], []
    for index, (ids, length) in enumerate(pairs):
        request = GenerateRequest(
            f"pair-{index}", ids, {"max_new_tokens": 1}, return_logprob=True, logprob_start_len=0
        )
        scheduler.add_request(request)
        batch = scheduler._next_batch()
        assert batch is not None
        rows = scheduler.executor.forward(batch.forward)[0].float()
        # Row 0 is the sampled (last) position; rows 1.. predict tokens 1.. of the prompt.
        scheduler._publish(
            scheduler._decide(batch.reqs, batch.samples, batch.is_prefill, [[int(rows[0].argmax())]])
        )
        logprobs = torch.log_softmax(rows[1:], dim=-1)
        targets = torch.tensor(ids[1:])
        picked = logprobs[torch.arange(len(targets)), targets]
        sums.append(float(picked[-length:].sum()))
        greedy.append(logprobs[-length:].argmax(dim=-1).tolist())
    scheduler.check_kv_invariant()
    return sums, greedy


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-path", default=None, help="a GGUF file (default: the packaged SmolLM2)")
    parser.add_argument("--pairs", type=int, default=150)
    options = parser.parse_args()
    base = ServerArgs(model_path=options.model_path, max_total_tokens=1024, log_level="warning")
    tokenizer = load_tokenizer(resolve_model_source(base.model_path))
    pairs = make_pairs(tokenizer, options.pairs)

    def run(**fields: str | None) -> tuple[list[float], list[list[int]]]:
        return loglikelihoods(ServerArgs(**{**vars(base), **fields}), pairs)

    reference, reference_greedy = run(quantization="none", dtype="float32")
    print(f"{len(pairs)} pairs; reference: --quantization none --dtype float32")
    print("| configuration | max abs delta loglik | mean abs delta | argmax agreement |")
    print("|---|---|---|---|")
    for name, (fields, activations) in CONFIGS.items():
        os.environ[ACTIVATIONS_ENV] = activations
        sums, greedy = run(**fields)
        deltas = torch.tensor(sums) - torch.tensor(reference)
        agree = sum(g == r for g, r in zip(greedy, reference_greedy, strict=True))
        worst, mean = float(deltas.abs().max()), float(deltas.abs().mean())
        print(f"| {name} | {worst:.3f} | {mean:.3f} | {agree}/{len(pairs)} |")


if __name__ == "__main__":
    main()
