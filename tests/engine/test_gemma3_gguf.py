"""The real Gemma 3 270M (Q4_K_M GGUF: Q4_K, Q5_0, Q6_K and Q8_0 blocks, 262k-token vocabulary,
sliding layers of 512 tokens): greedy text equal to transformers loading the same file in fp32,
served as the file holds it and dequantized; its tokenizer and end-of-turn token from the file."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from radixserve.config.server_args import ServerArgs
from radixserve.models.source import load_model_config, resolve_model_source
from radixserve.models.tokenizer import load_tokenizer
from radixserve.protocol.messages import GenerateRequest, ReqOutput
from radixserve.protocol.sampling_params import SamplingParams
from radixserve.scheduler.process import build_scheduler
from radixserve.scheduler.scheduler import Scheduler
from tests.engine.oracle import GreedyOracle
from tests.engine.test_smollm2_gguf import mean_error, prompt_logits

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
# Past the 512-token window: its sliding layers see the last part only, the global ones all of it.
_SIGHTINGS = [
    (color, animal, place)
    for place in ("river", "hill", "farm")
    for animal in ("fox", "owl", "deer", "hare")
    for color in ("red", "grey", "brown", "white", "black")
]
LONG_PROMPT = "Here is a list of the animals we saw on our trip.\n" + "".join(
    f"Day {day}: a {color} {animal} near the {place}.\n"
    for day, (color, animal, place) in enumerate(_SIGHTINGS, 1)
)
MAX_NEW = 16


@pytest.fixture(scope="module")
def one_parse(gemma3_gguf_path: Path) -> Iterator[None]:
    """Every GGUFReader of the file in this process is one parse: reading its metadata (the 262k
    tokens) takes ~8 s on a 2-core machine, and transformers alone reads it twice."""
    import gguf

    parse = functools.cache(gguf.GGUFReader)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", lambda path, *args: parse(os.path.realpath(path), *args))
        yield


@pytest.fixture(scope="module")
def prompts(gemma3_gguf_path: Path, one_parse: None) -> list[list[int]]:
    tokenizer = load_tokenizer(resolve_model_source(gemma3_gguf_path))
    ids = [tokenizer(text).input_ids for text in [*PROMPTS, LONG_PROMPT]]
    assert ids[0] == [2, 818, 5279, 529, 7001, 563]  # <bos> and the words, as transformers' tokenizer
    assert 512 < len(ids[-1]) < 1024
    return ids


@pytest.fixture(scope="module")
def reference(gemma3_gguf_path: Path, prompts: list[list[int]], one_parse: None) -> list[list[int]]:
    """transformers' greedy tokens, its model loaded from the same file (dequantized to fp32)."""
    oracle = GreedyOracle(gemma3_gguf_path.parent, gguf_file=gemma3_gguf_path.name, last_logits_only=True)
    return [oracle.continue_(ids, MAX_NEW) for ids in prompts]


def _generate(scheduler: Scheduler, prompts: list[list[int]]) -> list[list[int]]:
    """The prompts' greedy tokens, as one batch of an in-process scheduler."""
    params = SamplingParams.from_dict({"temperature": 0.0, "max_new_tokens": MAX_NEW, "ignore_eos": True})
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    finished: set[str] = set()

    def take(outputs: list[Any]) -> None:
        for out in outputs:
            if isinstance(out, ReqOutput):
                tokens[out.rid] += out.new_token_ids
                if out.finished_reason is not None:
                    finished.add(out.rid)

    for rid, ids in enumerate(prompts):
        take(list(scheduler.handle(GenerateRequest(str(rid), ids, params))))
    while len(finished) < len(prompts):
        take(list(scheduler.step()))
    scheduler.check_kv_invariant()
    return [tokens[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize(
    "args", [{}, {"quantization": "none", "dtype": "float32"}], ids=["quantized-blocks", "dequantized-fp32"]
)
def test_greedy_text_equals_transformers(
    args: dict[str, Any],
    gemma3_gguf_path: Path,
    prompts: list[list[int]],
    reference: list[list[int]],
    one_parse: None,
) -> None:
    """As the file holds it (the default: its blocks on the quantized kernel, fp32 activations, a
    bf16 KV cache), and dequantized to fp32: transformers' tokens on short prompts and one past the
    window, all in one batch."""
    scheduler = build_scheduler(
        ServerArgs(model_path=str(gemma3_gguf_path), max_total_tokens=2048, log_level="warning", **args)
    )
    runner: Any = scheduler.executor
    assert runner.describe()["attention_backend"] == "cpu_native"
    if not args:
        assert {"Q4_K", "Q6_K"} <= set(runner.quantized_bytes)
    assert _generate(scheduler, prompts) == reference


def test_the_saved_tokenizer_loads_as_the_fast_class_alone(
    gemma3_gguf_path: Path, prompts: list[list[int]]
) -> None:
    """The converted tokenizer, saved, loads as PreTrainedTokenizerFast (not GemmaTokenizer, which
    holds the 262k-token vocabulary a second time) and encodes as the conversion did."""
    from transformers import PreTrainedTokenizerFast

    saved = load_tokenizer(resolve_model_source(gemma3_gguf_path))
    assert type(saved) is PreTrainedTokenizerFast
    assert [saved(text).input_ids for text in [*PROMPTS, LONG_PROMPT]] == prompts
    assert saved.eos_token_id == 1 and saved.bos_token_id == 2


def test_the_config_and_tokens_come_from_the_file(gemma3_gguf_path: Path, one_parse: None) -> None:
    """llama.cpp's Gemma 3 as transformers reads it: every sixth layer global, the sliding ones on
    rotary base 10000; chat turns end on <end_of_turn> as well as <eos>."""
    config = load_model_config(resolve_model_source(gemma3_gguf_path))
    assert config.architecture == "Gemma3ForCausalLM" and config.vocab_size == 262144
    assert config.sliding_window == 512
    assert [i for i in range(18) if i not in config.sliding_layers] == [5, 11, 17]
    assert config.sliding_rope_theta == 10000.0 and config.rope_theta == 1_000_000.0
    assert config.query_pre_attn_scalar == 256 and config.tie_word_embeddings
    assert config.eos_token_ids == [1, 106]


def test_bfloat16_logits_stay_close_to_float32(gemma3_gguf_path: Path, one_parse: None) -> None:
    """Gemma 3 served in bf16 (dequantized) against fp32, as the SmolLM2 test holds the bf16 path:
    its mean |logit error| over every prompt position (~160) may exceed that of torch's own bf16 ops
    (--cpu-kernels torch) by at most 15%, and a first token fp32 decides clearly stays the same."""
    tokenizer = load_tokenizer(resolve_model_source(gemma3_gguf_path))
    # ~160 rows: the mean is then stable against the rounding of a few rows.
    prompts = [tokenizer(text).input_ids for text in [*PROMPTS, LONG_PROMPT[:400]]]
    path = str(gemma3_gguf_path)
    exact = prompt_logits("float32", prompts, model_path=path)
    by_torch = prompt_logits("bfloat16", prompts, cpu_kernels="torch", model_path=path)
    rounded = prompt_logits("bfloat16", prompts, model_path=path)
    ours, torchs = mean_error(exact, rounded), mean_error(exact, by_torch)
    assert ours <= 1.15 * torchs, (ours, torchs)
    decided = [
        (a, b) for a, b in zip(exact, rounded, strict=True) if float(a[0].topk(2).values.diff().abs()) > 0.5
    ]
    assert decided, "no prompt with a clear first token to compare"
    for a, b in decided:
        assert int(b[0].argmax()) == int(a[0].argmax())
