"""Messages that cross from the request side (Engine, TokenizerManager) into the scheduler and back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

FinishType = Literal["stop", "length", "abort"]


@dataclass
class GenerateRequest:
    rid: str
    input_ids: list[int]
    sampling_params: dict[str, Any] = field(default_factory=dict)


@dataclass
class AbortRequest:
    rid: str | None = None
    abort_all: bool = False


@dataclass
class ShutdownRequest:
    pass


@dataclass
class ControlRequest:
    """A request about the scheduler itself, answered by a ControlResult with the same rid."""

    rid: str
    command: str  # "check_kv_invariant" | "flush_cache" | "get_stats"


@dataclass
class ControlResult:
    rid: str
    ok: bool
    payload: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


@dataclass
class FinishReason:
    type: FinishType
    # The EOS / stop token id that ended the request, when one did.
    matched: int | str | None = None
    # Why an "abort" happened, for the user.
    message: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type, "matched": self.matched}
        if self.message is not None:
            out["message"] = self.message
        return out


@dataclass
class ReqOutput:
    """What the scheduler emits for one request after a step: the new tokens, and the end if reached."""

    rid: str
    new_token_ids: list[int]
    finished_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


SchedulerInput = GenerateRequest | AbortRequest | ControlRequest | ShutdownRequest
SchedulerOutput = ReqOutput | ControlResult


@dataclass
class SchedulerReady:
    """The scheduler process's first message: the model is loaded and the KV cache sized."""

    max_total_tokens: int
    context_len: int
    vocab_size: int


@dataclass
class SchedulerFailed:
    """The scheduler process's last message when it dies of an error."""

    error: str
