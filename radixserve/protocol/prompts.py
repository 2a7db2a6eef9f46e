"""The shapes a prompt may take in the Python API (text, token ids, or vectors; one or a batch),
turned into one list of ids and one of vectors per request."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from radixserve.protocol.sampling_params import InvalidRequestError

Prompt = str | list[str] | None
InputIds = list[int] | list[list[int]] | None
InputEmbeds = list[list[float]] | list[list[list[float]]] | None


@dataclass
class PromptBatch:
    ids: list[list[int]]  # empty for a prompt given as vectors
    embeds: list[list[list[float]] | None]
    single: bool  # one prompt was given (not a list of them)


def split_prompts(
    prompt: Prompt,
    input_ids: InputIds,
    input_embeds: InputEmbeds,
    tokenize: Callable[[str], list[int]],
    text_name: str = "prompt",
) -> PromptBatch:
    if sum(x is not None for x in (prompt, input_ids, input_embeds)) != 1:
        raise InvalidRequestError(f"pass exactly one of {text_name}, input_ids or input_embeds")
    if input_embeds is not None:
        # One prompt is a list of vectors; a batch is a list of those.
        first: Any = input_embeds[0] if input_embeds else None
        single = not (first and isinstance(first[0], list))
        embeds: list[Any] = [input_embeds] if single else list(input_embeds)
        return PromptBatch([[] for _ in embeds], embeds, single)
    if prompt is not None:
        texts = [prompt] if isinstance(prompt, str) else list(prompt)
        return PromptBatch([tokenize(t) for t in texts], [None] * len(texts), isinstance(prompt, str))
    assert input_ids is not None
    single = bool(input_ids) and isinstance(input_ids[0], int)
    if not single and not all(isinstance(x, list) for x in input_ids):
        raise InvalidRequestError("input_ids must be a list of token ids, or a list of such lists")
    ids: list[Any] = [list(input_ids)] if single else [list(x) for x in input_ids if isinstance(x, list)]
    return PromptBatch(ids, [None] * len(ids), single)


@dataclass(frozen=True)
class PromptLimits:
    context_len: int
    max_total_tokens: int
    allow_auto_truncate: bool

    def allowed_prompt_len(self, length: int, embed: bool) -> int:
        """How much of a prompt of this length is kept (all, unless --allow-auto-truncate cuts it)."""
        # A generation request needs room for at least one new token.
        longest = self.context_len if embed else self.context_len - 1
        if length > longest and not self.allow_auto_truncate:
            raise InvalidRequestError(
                f"the prompt has {length} tokens, but the model's context length is "
                f"{self.context_len} tokens; shorten the prompt (or start the server with "
                "--allow-auto-truncate)"
            )
        length = min(length, longest)
        if length + 1 > self.max_total_tokens:
            raise InvalidRequestError(
                f"the prompt has {length} tokens, more than the KV cache can ever hold "
                f"({self.max_total_tokens} tokens); shorten it or raise --max-total-tokens"
            )
        return length


def check_input_embeds(embeds: Any, hidden_size: int) -> None:
    if (
        not isinstance(embeds, list)
        or not embeds
        or any(not isinstance(row, list) or len(row) != hidden_size for row in embeds)
    ):
        raise InvalidRequestError(
            f"input_embeds must be a non-empty list of vectors of {hidden_size} numbers"
        )
    if any(not isinstance(x, (int, float)) or not math.isfinite(x) for row in embeds for x in row):
        raise InvalidRequestError("input_embeds must hold finite numbers only")
