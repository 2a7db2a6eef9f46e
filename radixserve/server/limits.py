"""Bounds of what one HTTP call may ask for, and the sampling parameters' check at the edge.

SamplingParams (protocol/) is the one check of the sampling parameters' types, ranges and sizes;
an HTTP request's runs here, once (parse_sampling_params), and its InvalidRequestError becomes a
400 whose `param` names the field as the client spelled it (OpenAI's names on the OpenAI routes).
"""

from __future__ import annotations

from typing import Any

from radixserve.protocol.sampling_params import TOKEN_ID_LIMIT, InvalidRequestError, SamplingParams
from radixserve.runtime.request_builder import MAX_TOP_LOGPROBS as MAX_TOP_LOGPROBS
from radixserve.server.errors import ApiError

# Prompts in one request (a list of prompts, or of token-id lists), and choices (prompts x n).
MAX_BATCH = 1024


def per_prompt(value: Any, count: int, name: str) -> list[Any]:
    """A field given once for the batch or once per prompt, as one value per prompt."""
    if isinstance(value, list):
        if len(value) != count:
            raise ApiError(400, f"{name} must have one entry per prompt", param=name)
        return value
    return [value] * count


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_token_ids(ids: Any, param: str) -> None:
    if not isinstance(ids, list):
        raise ApiError(400, f"{param} must be a list of token ids", param=param)
    for index, token in enumerate(ids):
        if not _is_int(token) or not 0 <= token < TOKEN_ID_LIMIT:
            raise ApiError(
                400,
                f"{param}[{index}] must be a token id, an integer in [0, 2**31)",
                param=f"{param}[{index}]",
            )


def check_batch(count: int, param: str) -> None:
    if count > MAX_BATCH:
        raise ApiError(400, f"{param} holds {count} prompts; at most {MAX_BATCH} per request", param=param)


def parse_sampling_params(params: Any, param: str, names: dict[str, str] | None = None) -> SamplingParams:
    """The native sampling parameters of an HTTP body, checked once (SamplingParams.from_dict; a
    field set to null takes its default): the request carries the result from here on. A refusal
    names the field as the client spelled it: `param` is where the parameters sit in the body, and
    `names` maps native names to the client's (OpenAI's)."""
    if params is not None and not isinstance(params, dict):
        raise ApiError(400, f"{param} must be a JSON object", param=param)
    try:
        return SamplingParams.from_dict(params)
    except InvalidRequestError as exc:
        field = (names or {}).get(exc.param or "", exc.param)
        where = ".".join(part for part in (param, field) if part) or None
        raise ApiError(400, str(exc), param=where) from exc
