"""SamplingParams: how one request picks its tokens and when it stops (SGLang's field names)."""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass, field
from typing import Any

# Temperatures below this are treated as greedy: dividing logits by ~0 only overflows.
GREEDY_TEMPERATURE = 1e-5
# The json_schema value that response_format {"type": "json_object"} stands for: any JSON object.
ANY_JSON = "$any_json"


class InvalidRequestError(ValueError):
    """The request cannot be served as given; the message says what is wrong and `param`, when
    set, names the field (its native name: the HTTP layer maps it to the name its client used)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


# Bounds on what one request may ask for (OpenAI allows 4 stop strings; SGLang has no bound).
MAX_STOP = 16
MAX_STOP_CHARS = 1024
MAX_LOGIT_BIAS = 1024
MAX_STOP_TOKEN_IDS = 1024
# Token ids are 32-bit; the vocabulary check, against the model's size, is check_vocab.
TOKEN_ID_LIMIT = 2**31

_INT_FIELDS = ("max_new_tokens", "top_k", "min_new_tokens")
_NUMBER_FIELDS = (
    "temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
)  # fmt: skip
_BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _is_token_id(value: Any) -> bool:
    return _is_int(value) and 0 <= value < TOKEN_ID_LIMIT


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    # Stop strings: generation ends when the output text contains one; it is trimmed from the text
    # unless no_stop_trim is set.
    stop: list[str] = field(default_factory=list)
    # Before this many tokens, EOS and stop tokens are masked out and stop strings are not checked.
    min_new_tokens: int = 0
    ignore_eos: bool = False
    # OpenAI's penalties over output tokens, HF's repetition penalty over prompt + output tokens.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Token id → value added to its logit (OpenAI: -100..100; -100 effectively bans the token).
    logit_bias: dict[str, float] = field(default_factory=dict)
    skip_special_tokens: bool = True
    # Passed to the tokenizer's decode: slow (Python) tokenizers put spaces around special tokens
    # when True; fast tokenizers ignore it (as they do under SGLang and vLLM).
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    # Arguments for the request's custom logit processor (see scheduler/logit_processors.py).
    custom_params: dict[str, Any] | None = None
    # Structured output: at most one grammar (see scheduler/grammar.py).
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None

    @classmethod
    def from_dict(cls, params: dict[str, Any] | None) -> SamplingParams:
        """The parameters as sent (a JSON object); a field set to null takes its default. This is
        the one check of their types, ranges and sizes, for Engine callers and HTTP clients alike."""
        if params is not None and not isinstance(params, dict):
            raise InvalidRequestError("sampling_params must be a JSON object")
        params = {k: v for k, v in (params or {}).items() if v is not None}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(params) - known)
        if unknown:
            raise InvalidRequestError(f"unsupported sampling parameter(s): {', '.join(unknown)}", unknown[0])
        if isinstance(params.get("stop"), str):
            params["stop"] = [params["stop"]]
        sp = cls(**params)
        sp.validate()
        return sp

    def validate(self) -> None:
        self._check_types()
        if self.max_new_tokens < 0:
            raise InvalidRequestError(
                f"max_new_tokens must be a non-negative integer, got {self.max_new_tokens!r}",
                "max_new_tokens",
            )
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k == 0 or self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1 (off) or >= 1, got {self.top_k}", "top_k")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if any(not s for s in self.stop):
            raise InvalidRequestError(
                "stop must be a non-empty string or a list of non-empty strings", "stop"
            )
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {value}", name)
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise InvalidRequestError(
                f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}", "repetition_penalty"
            )
        grammars = [n for n in GRAMMAR_FIELDS if getattr(self, n) is not None]
        if len(grammars) > 1:
            raise InvalidRequestError(
                f"pass at most one of json_schema, regex, ebnf, structural_tag; got {grammars}", grammars[1]
            )
        if self.min_new_tokens < 0:
            raise InvalidRequestError(
                f"min_new_tokens must be >= 0, got {self.min_new_tokens!r}", "min_new_tokens"
            )
        if self.min_new_tokens > self.max_new_tokens:
            raise InvalidRequestError(
                f"min_new_tokens ({self.min_new_tokens}) must not exceed max_new_tokens "
                f"({self.max_new_tokens})",
                "min_new_tokens",
            )

    def _check_types(self) -> None:
        """JSON types and sizes first, so that the range checks above only ever compare numbers and
        nothing further in can be handed a value it cannot hold."""
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if not _is_int(value):
                raise InvalidRequestError(f"{name} must be an integer, got {value!r:.100}", name)
        if self.seed is not None and not _is_int(self.seed):
            raise InvalidRequestError(f"seed must be an integer, got {self.seed!r:.100}", "seed")
        for name in _NUMBER_FIELDS:
            value = getattr(self, name)
            if not _is_number(value):
                raise InvalidRequestError(f"{name} must be a finite number, got {value!r:.100}", name)
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(
                    f"{name} must be true or false, got {getattr(self, name)!r:.100}", name
                )
        for name in GRAMMAR_FIELDS:
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise InvalidRequestError(f"{name} must be a string", name)
        if self.custom_params is not None and not isinstance(self.custom_params, dict):
            raise InvalidRequestError("custom_params must be a JSON object", "custom_params")
        self._check_stop()
        ids = self.stop_token_ids
        if not isinstance(ids, list) or len(ids) > MAX_STOP_TOKEN_IDS or not all(map(_is_token_id, ids)):
            raise InvalidRequestError(
                f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} token ids (integers in "
                "[0, 2**31))",
                "stop_token_ids",
            )
        self._check_logit_bias()

    def _check_stop(self) -> None:
        stops = self.stop
        if not isinstance(stops, list) or any(not isinstance(s, str) for s in stops):
            raise InvalidRequestError("stop must be a string or a list of strings", "stop")
        if len(stops) > MAX_STOP:
            raise InvalidRequestError(f"stop holds {len(stops)} strings; at most {MAX_STOP}", "stop")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise InvalidRequestError(f"stop strings must be at most {MAX_STOP_CHARS} characters", "stop")

    def _check_logit_bias(self) -> None:
        bias = self.logit_bias
        if not isinstance(bias, dict):
            raise InvalidRequestError("logit_bias must map token ids to numbers", "logit_bias")
        if len(bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(
                f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS}", "logit_bias"
            )
        for token, value in bias.items():
            # Decimal ASCII digits only: str.isdigit() also takes "²", which int() refuses.
            if (
                not isinstance(token, str)
                or not token.isascii()
                or not token.isdigit()
                or int(token) >= TOKEN_ID_LIMIT
            ):
                raise InvalidRequestError(
                    f"logit_bias keys must be token ids (decimal integers below 2**31), got {token!r:.40}",
                    "logit_bias",
                )
            if not _is_number(value) or not -100 <= value <= 100:
                raise InvalidRequestError(
                    f"logit_bias values must be numbers in [-100, 100], got {token!r:.40}: {value!r:.40}",
                    "logit_bias",
                )

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids in the parameters must exist in the model's vocabulary."""
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        bad += [int(t) for t in self.logit_bias if int(t) >= vocab_size]
        if bad:
            name = "stop_token_ids" if any(t >= vocab_size for t in self.stop_token_ids) else "logit_bias"
            raise InvalidRequestError(
                f"token ids {bad[:5]} are outside the vocabulary (size {vocab_size})", name
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """The sampling parameters of choice `index` of an n > 1 request. With a seed, each choice gets
    its own seed derived from it (choice 0 keeps it), so the n samples differ and the whole answer
    is reproducible; without one they already differ."""
    seed = params.seed
    if index == 0 or seed is None:
        return params
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return dataclasses.replace(params, seed=int.from_bytes(digest, "little") >> 1)
