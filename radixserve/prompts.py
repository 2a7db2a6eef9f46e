"""The shapes a prompt may take in the Python API (text, token ids, or vectors; one or a batch),
turned into one list of ids and one of vectors per request."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from radixserve.sampling_params import InvalidRequestError

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
