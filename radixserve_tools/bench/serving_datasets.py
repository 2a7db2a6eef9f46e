"""Request sets for `radixserve bench serving`: random, generated-shared-prefix and ShareGPT.

Synthetic datasets produce token-id prompts, so the client needs no tokenizer and prompt lengths
are exact; the server accepts `prompt: [ids]` on /v1/completions. ShareGPT produces text prompts.
This module stays free of heavy imports (transformers is loaded only when a tokenizer is asked for)
because the CLI imports it to build its parser.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

DATASET_NAMES: tuple[str, ...] = ("random", "generated-shared-prefix", "sharegpt")

# Ids below 100 hold the special tokens (BOS/EOS, chat markers) of most vocabularies; a random
# prompt hitting one could end generation early or change how the server parses the prompt.
TOKEN_ID_LO = 100

# Without a tokenizer, English text averages about four characters per token.
CHARS_PER_TOKEN = 4


class Tokenizer(Protocol):
    """The slice of a transformers tokenizer the datasets use.

    Positional-only and returning Any: transformers' parameter names and return unions differ
    across versions and tokenizer backends.
    """

    def encode(self, text: str, /, *, add_special_tokens: bool = ...) -> Any: ...

    def decode(self, ids: list[int], /) -> Any: ...


@dataclass(frozen=True)
class BenchRequest:
    """One request to send: a text or token-id prompt and how many tokens to ask for."""

    prompt: str | list[int]
    # Exact for token-id prompts and tokenized text; estimated (chars/4) otherwise. The report
    # prefers the server's usage.prompt_tokens and falls back to this.
    prompt_len: int
    output_len: int


def load_tokenizer(path: str) -> Tokenizer:
    """A transformers tokenizer from a local directory, or a GGUF file's (as the server loads it);
    never downloads."""
    if path.endswith(".gguf"):
        from radixserve.models.source import ModelSource
        from radixserve.models.tokenizer import load_tokenizer as load_model_tokenizer

        gguf_tokenizer: Tokenizer = load_model_tokenizer(ModelSource("gguf", Path(path)))
        return gguf_tokenizer
    from radixserve.models.tokenizer import load_tokenizer_dir

    tokenizer: Tokenizer = load_tokenizer_dir(path)
    return tokenizer


def _check_vocab(vocab_size: int) -> None:
    if vocab_size <= TOKEN_ID_LO:
        raise ValueError(f"vocab size must be > {TOKEN_ID_LO} (ids start there), got {vocab_size}")


def _random_ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(TOKEN_ID_LO, vocab_size) for _ in range(n)]


def sample_random_requests(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 1.0,
    vocab_size: int = 10000,
    seed: int = 1,
) -> list[BenchRequest]:
    """Random token-id prompts; each length is uniform in [range_ratio * len, len] (at least 1)."""
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"random range ratio must be in [0, 1], got {range_ratio}")
    if input_len < 1 or output_len < 1:
        raise ValueError("random input and output lengths must be >= 1")
    _check_vocab(vocab_size)
    rng = random.Random(seed)
    requests = []
    for _ in range(num_prompts):
        in_len = rng.randint(max(1, int(range_ratio * input_len)), input_len)
        out_len = rng.randint(max(1, int(range_ratio * output_len)), output_len)
        requests.append(BenchRequest(_random_ids(rng, in_len, vocab_size), in_len, out_len))
    return requests


def sample_generated_shared_prefix_requests(
    num_groups: int,
    prompts_per_group: int,
    system_prompt_len: int,
    question_len: int,
    output_len: int,
    vocab_size: int = 10000,
    seed: int = 1,
) -> list[BenchRequest]:
    """`num_groups` random system prompts, each followed by `prompts_per_group` distinct questions.

    The result is shuffled: sent in order, every group's requests would arrive back to back, which
    flatters a prefix cache with the easiest possible access pattern.
    """
    if min(num_groups, prompts_per_group, system_prompt_len, question_len, output_len) < 1:
        raise ValueError("generated-shared-prefix counts and lengths must be >= 1")
    _check_vocab(vocab_size)
    rng = random.Random(seed)
    requests = []
    for _ in range(num_groups):
        system = _random_ids(rng, system_prompt_len, vocab_size)
        for _ in range(prompts_per_group):
            prompt = system + _random_ids(rng, question_len, vocab_size)
            requests.append(BenchRequest(prompt, len(prompt), output_len))
    rng.shuffle(requests)
    return requests


def _text_len(text: str, tokenizer: Tokenizer | None) -> int:
    if tokenizer is not None:
        return len(tokenizer.encode(text, add_special_tokens=False))
    return max(1, round(len(text) / CHARS_PER_TOKEN))


def _first_exchange(conversation: Any) -> tuple[str, str] | None:
    """The first human turn and the gpt turn answering it, or None if there is no such pair."""
    turns = conversation.get("conversations") if isinstance(conversation, dict) else None
    if not isinstance(turns, list) or len(turns) < 2:
        return None
    for i, turn in enumerate(turns[:-1]):
        nxt = turns[i + 1]
        if not (isinstance(turn, dict) and isinstance(nxt, dict)):
            continue
        if turn.get("from") == "human" and nxt.get("from") == "gpt":
            prompt, answer = turn.get("value"), nxt.get("value")
            if isinstance(prompt, str) and isinstance(answer, str) and prompt.strip():
                return prompt, answer
    return None


def sample_sharegpt_requests(
    path: str | Path,
    num_prompts: int,
    tokenizer: Tokenizer | None = None,
    fixed_output_len: int | None = None,
    seed: int = 1,
) -> list[BenchRequest]:
    """Text prompts from a ShareGPT JSON file: the first human turn of each usable conversation.

    The output length is the reply's token count (the tokenizer's, else chars/4) unless
    `fixed_output_len` is given. Conversations are shuffled with `seed` before taking
    `num_prompts`, so a subset is a fair sample rather than the head of the file. Fewer requests
    come back when the file has fewer usable conversations.
    """
    if fixed_output_len is not None and fixed_output_len < 1:
        raise ValueError(f"sharegpt output length must be >= 1, got {fixed_output_len}")
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of conversations")
    pairs = [pair for pair in map(_first_exchange, data) if pair is not None]
    random.Random(seed).shuffle(pairs)
    requests = []
    for prompt, answer in pairs[:num_prompts]:
        out_len = fixed_output_len if fixed_output_len is not None else _text_len(answer, tokenizer)
        requests.append(BenchRequest(prompt, _text_len(prompt, tokenizer), max(1, out_len)))
    return requests
