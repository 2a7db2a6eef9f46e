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
from pathlib import Path

import torch

from radixserve.models.source import resolve_model_source
from radixserve.models.tokenizer import load_tokenizer
from radixserve.runtime.engine import Engine

# name -> ServerArgs fields
CONFIGS: dict[str, dict[str, str | None]] = {
    "dense bf16 (--quantization none --dtype bfloat16)": {"quantization": "none", "dtype": "bfloat16"},
    "quantized, fp32, bf16 KV cache (default)": {"quantization": None, "dtype": "float32"},
    "quantized, fp32, --kv-cache-dtype float32": {
        "quantization": None,
        "dtype": "float32",
        "kv_cache_dtype": "float32",
    },
    "quantized, --dtype bfloat16": {"quantization": None, "dtype": "bfloat16"},
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
    model_path: str | None, fields: dict[str, str | None], pairs: list[tuple[list[int], int]]
) -> tuple[list[float], list[list[int]]]:
    """Per pair: the continuation's summed log-probability and its greedy tokens, from the prompt
    logprobs of one engine serving the model with `fields`."""
    engine = Engine(model_path=model_path, max_total_tokens=2048, log_level="warning", **fields)  # type: ignore[arg-type]
    sums, greedy = [], []
    try:
        for ids, length in pairs:
            out = engine.generate(
                input_ids=ids,
                sampling_params={"max_new_tokens": 1, "temperature": 0.0},
                return_logprob=True,
                logprob_start_len=0,
                top_logprobs_num=1,
            )
            assert isinstance(out, dict)
            meta = out["meta_info"]
            sums.append(sum(float(v) for v, _, _ in meta["input_token_logprobs"][-length:]))
            greedy.append([int(top[0][1]) for top in meta["input_top_logprobs"][-length:]])
        engine.check_kv_invariant()
    finally:
        engine.shutdown()
    return sums, greedy


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-path", default=None, help="a GGUF file (default: the packaged SmolLM2)")
    parser.add_argument("--pairs", type=int, default=150)
    options = parser.parse_args()
    tokenizer = load_tokenizer(resolve_model_source(options.model_path))
    pairs = make_pairs(tokenizer, options.pairs)

    def run(**fields: str | None) -> tuple[list[float], list[list[int]]]:
        return loglikelihoods(options.model_path, fields, pairs)

    reference, reference_greedy = run(quantization="none", dtype="float32")
    print(f"{len(pairs)} pairs; reference: --quantization none --dtype float32")
    print("| configuration | max abs delta loglik | mean abs delta | argmax agreement |")
    print("|---|---|---|---|")
    for name, fields in CONFIGS.items():
        sums, greedy = run(**fields)
        deltas = torch.tensor(sums) - torch.tensor(reference)
        agree = sum(g == r for g, r in zip(greedy, reference_greedy, strict=True))
        worst, mean = float(deltas.abs().max()), float(deltas.abs().mean())
        print(f"| {name} | {worst:.3f} | {mean:.3f} | {agree}/{len(pairs)} |")


if __name__ == "__main__":
    main()
