"""Bounds and types of what a request may ask for, checked at the edge with a 400 naming the field.

SamplingParams (protocol/) checks values; this module makes sure that what reaches it has the right
JSON types and sizes, so that no request can raise anything but a clean 400 further in.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from radixserve.runtime.engine import MAX_TOP_LOGPROBS as MAX_TOP_LOGPROBS
from radixserve.server.errors import ApiError

# Stop strings per request (OpenAI allows 4; SGLang has no bound) and characters per stop string.
MAX_STOP = 16
MAX_STOP_CHARS = 1024
# Entries of logit_bias, and of stop_token_ids.
MAX_LOGIT_BIAS = 1024
MAX_STOP_TOKEN_IDS = 1024
# Prompts in one request (a list of prompts, or of token-id lists).
MAX_BATCH = 1024
# Token ids are 32-bit (the vocabulary check, against the model's size, follows in the engine).
TOKEN_ID_LIMIT = 2**31

_INT_FIELDS = ("max_new_tokens", "top_k", "min_new_tokens", "seed")
_NUMBER_FIELDS = (
    "temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
)  # fmt: skip
_BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")
_STRING_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")
_DIGITS = re.compile(r"[0-9]+")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


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


def check_sampling_params(params: Any, param: str, names: dict[str, str] | None = None) -> dict[str, Any]:
    """The native sampling parameters with their JSON types and sizes checked; a field set to null
    takes its default. `names` maps native names to the names the client used (OpenAI's)."""
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise ApiError(400, f"{param} must be a JSON object", param=param)
    names = names or {}

    def where(name: str) -> str:
        name = names.get(name, name)
        return f"{param}.{name}" if param else name

    def bad(name: str, problem: str) -> ApiError:
        return ApiError(400, f"{where(name)} {problem}", param=where(name))

    checked: dict[str, Any] = {}
    for name, value in params.items():
        if value is None:
            continue
        if name in _INT_FIELDS and not _is_int(value):
            raise bad(name, f"must be an integer, got {value!r:.100}")
        if name in _NUMBER_FIELDS and not _is_number(value):
            raise bad(name, f"must be a number, got {value!r:.100}")
        if name in _BOOL_FIELDS and not isinstance(value, bool):
            raise bad(name, f"must be true or false, got {value!r:.100}")
        if name in _STRING_FIELDS and not isinstance(value, str):
            raise bad(name, "must be a string")
        if name == "custom_params" and not isinstance(value, dict):
            raise bad(name, "must be a JSON object")
        if name == "stop":
            _check_stop(value, bad)
        if name == "stop_token_ids":
            if not isinstance(value, list) or len(value) > MAX_STOP_TOKEN_IDS:
                raise bad(name, f"must be a list of at most {MAX_STOP_TOKEN_IDS} token ids")
            check_token_ids(value, where(name))
        if name == "logit_bias":
            _check_logit_bias(value, bad)
        checked[name] = value
    return checked


def _check_stop(value: Any, bad: Callable[[str, str], ApiError]) -> None:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or any(not isinstance(s, str) for s in stops):
        raise bad("stop", "must be a string or a list of strings")
    if len(stops) > MAX_STOP:
        raise bad("stop", f"holds {len(stops)} strings; at most {MAX_STOP}")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise bad("stop", f"strings must be at most {MAX_STOP_CHARS} characters")


def _check_logit_bias(value: Any, bad: Callable[[str, str], ApiError]) -> None:
    if not isinstance(value, dict):
        raise bad("logit_bias", "must map token ids to numbers")
    if len(value) > MAX_LOGIT_BIAS:
        raise bad("logit_bias", f"has {len(value)} entries; at most {MAX_LOGIT_BIAS}")
    for token, bias in value.items():
        if not _DIGITS.fullmatch(token) or int(token) >= TOKEN_ID_LIMIT:
            raise bad(
                "logit_bias", f"keys must be token ids (decimal integers below 2**31), got {token!r:.40}"
            )
        if not _is_number(bias) or not -100 <= bias <= 100:
            raise bad("logit_bias", f"values must be numbers in [-100, 100], got {bias!r:.40}")
