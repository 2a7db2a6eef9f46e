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
    """The request cannot be served as given; the message says which field is wrong."""


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
        params = dict(params or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(params) - known)
        if unknown:
            raise InvalidRequestError(f"unsupported sampling parameter(s): {', '.join(unknown)}")
        for key in ("stop_token_ids", "stop", "logit_bias"):
            if params.get(key) is None:
                params.pop(key, None)
        if isinstance(params.get("stop"), str):
            params["stop"] = [params["stop"]]
        sp = cls(**params)
        sp.validate()
        return sp

    def validate(self) -> None:
        self._check_types()
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise InvalidRequestError(
                f"max_new_tokens must be a non-negative integer, got {self.max_new_tokens!r}"
            )
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be a list of non-negative integers")
        if not isinstance(self.stop, list) or any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop must be a non-empty string or a list of non-empty strings")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {value}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise InvalidRequestError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if not isinstance(self.logit_bias, dict):
            raise InvalidRequestError("logit_bias must map token ids to numbers")
        for token, bias in self.logit_bias.items():
            if not str(token).isdigit() or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
                raise InvalidRequestError(
                    f"logit_bias must map token ids to values in [-100, 100], got {token!r}: {bias!r}"
                )
        grammars = [
            n for n in ("json_schema", "regex", "ebnf", "structural_tag") if getattr(self, n) is not None
        ]
        if len(grammars) > 1:
            raise InvalidRequestError(
                f"pass at most one of json_schema, regex, ebnf, structural_tag; got {grammars}"
            )
        if grammars and not isinstance(getattr(self, grammars[0]), str):
            raise InvalidRequestError(f"{grammars[0]} must be a string")
        for flag in ("skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "ignore_eos"):
            if not isinstance(getattr(self, flag), bool):
                raise InvalidRequestError(f"{flag} must be true or false, got {getattr(self, flag)!r}")
        if self.custom_params is not None and not isinstance(self.custom_params, dict):
            raise InvalidRequestError("custom_params must be a JSON object")
        if not isinstance(self.min_new_tokens, int) or self.min_new_tokens < 0:
            raise InvalidRequestError(f"min_new_tokens must be >= 0, got {self.min_new_tokens!r}")
        if self.min_new_tokens > self.max_new_tokens:
            raise InvalidRequestError(
                f"min_new_tokens ({self.min_new_tokens}) must not exceed max_new_tokens "
                f"({self.max_new_tokens})"
            )

    def _check_types(self) -> None:
        """JSON types first, so that the range checks below only ever compare numbers."""
        for name in ("max_new_tokens", "top_k", "min_new_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise InvalidRequestError(f"{name} must be an integer, got {value!r:.100}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise InvalidRequestError(f"seed must be an integer, got {self.seed!r:.100}")
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "frequency_penalty",
            "presence_penalty",
            "repetition_penalty",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise InvalidRequestError(f"{name} must be a finite number, got {value!r:.100}")
        if not isinstance(self.stop_token_ids, list):
            raise InvalidRequestError("stop_token_ids must be a list of non-negative integers")
        if any(isinstance(t, bool) for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be a list of non-negative integers")
        if isinstance(self.logit_bias, dict):
            for token, bias in self.logit_bias.items():
                if (
                    not isinstance(token, str)
                    or not token.isascii()
                    or not token.isdigit()
                    or isinstance(bias, bool)
                    or not isinstance(bias, (int, float))
                    or not math.isfinite(bias)
                ):
                    pair = f"{token!r:.40}: {bias!r:.40}"
                    raise InvalidRequestError(
                        f"logit_bias must map token ids to values in [-100, 100], got {pair}"
                    )

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids in the parameters must exist in the model's vocabulary."""
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        bad += [int(t) for t in self.logit_bias if int(t) >= vocab_size]
        if bad:
            raise InvalidRequestError(f"token ids {bad[:5]} are outside the vocabulary (size {vocab_size})")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


def choice_params(params: dict[str, Any], index: int) -> dict[str, Any]:
    """The sampling parameters of choice `index` of an n > 1 request. With a seed, each choice gets
    its own seed derived from it (choice 0 keeps it), so the n samples differ and the whole answer
    is reproducible; without one they already differ."""
    seed = params.get("seed")
    if index == 0 or not isinstance(seed, int):
        return params
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return {**params, "seed": int.from_bytes(digest, "little") >> 1}
