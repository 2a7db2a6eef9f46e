"""Every message that crosses a process boundary.

The path is one way: the engine (tokenizer side) sends requests to the scheduler; the scheduler sends
token ids to the detokenizer; the detokenizer turns them into text and sends it to the engine. Control
results and the scheduler's last words pass through the detokenizer unchanged, so they stay in order
with the outputs before them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Literal

from radixserve.protocol.sampling_params import SamplingParams

FinishType = Literal["stop", "length", "abort"]


@dataclass
class BootstrapInfo:
    """Where a request's other half runs under prefill/decode disaggregation, as sglang-router
    --pd-disaggregation sends it: the prefill server's host and bootstrap port, and the room (a
    number the router picks) that names this request on both servers."""

    host: str
    port: int
    room: int


@dataclass
class ImageInput:
    """One image of a prompt, as its model's image processor made it: float32 pixel values
    (row-major, of `shape`, [channels, height, width]), their SHA-256 in hex (over the shape and
    the bytes, so equal images have equal digests), and the position in input_ids where its image
    tokens start (as many as the model gives an image)."""

    digest: str
    pixel_values: bytes
    shape: list[int]
    offset: int


def image_digest(shape: list[int], pixel_values: bytes) -> str:
    """ImageInput.digest: the same in every process for equal pixel values."""
    return hashlib.sha256(repr(list(shape)).encode() + pixel_values).hexdigest()


# Tokens between a non-streaming request's outputs (GenerateRequest.stream; SGLang's figure).
NON_STREAM_OUTPUT_INTERVAL = 50


@dataclass
class GenerateRequest:
    rid: str
    input_ids: list[int]
    # Checked once, where the request is made (SamplingParams.from_dict); the scheduler takes it
    # as it comes.
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    # Logprobs of the output tokens (raw distribution), and of this many top alternatives per token.
    return_logprob: bool = False
    top_logprobs_num: int = 0
    # With return_logprob: also the prompt tokens' logprobs from this position on (-1: none).
    logprob_start_len: int = -1
    # With return_logprob: the logprobs of these token ids at every position, too.
    token_ids_logprob: list[int] | None = None
    # The session this request belongs to and the request it continues from (engine-side
    # bookkeeping for sessions.py; the scheduler does not look at them).
    session_id: str | None = None
    session_parent: str | None = None
    # The prompt as embedding vectors ([length][hidden_size]) instead of ids; input_ids is empty.
    input_embeds: list[list[float]] | None = None
    # Return the final (normed) hidden state behind each output token.
    return_hidden_states: bool = False
    # "module.path:ClassName" of a logit processor the server can import (needs
    # --enable-custom-logit-processor); its arguments are sampling_params["custom_params"].
    custom_logit_processor: str | None = None
    # Under --disaggregation-mode: the other server of this request (BootstrapInfo).
    bootstrap: BootstrapInfo | None = None
    # --enable-lora: the name of the LoRA adapter to run with (SGLang's field name); None: the base.
    lora_path: str | None = None
    # Vision-language models: the prompt's images, in order; each one's tokens sit in input_ids as
    # the model's image token id (the scheduler keys them by the image's digest).
    images: list[ImageInput] | None = None
    # SGLang's `priority` (None: the default, 0); used under --enable-priority-scheduling.
    priority: int | None = None
    # Whether the caller reads the output as it comes. One that waits for the whole answer (a
    # non-streaming call) is sent its first token, then every NON_STREAM_OUTPUT_INTERVAL tokens and
    # the end, rather than every --stream-interval: fewer messages for the processes beside the
    # model's on a small machine.
    stream: bool = True


@dataclass
class AbortRequest:
    """Ends the requests whose rid starts with `rid` (exact: only that rid), or all of them, with
    finish reason "abort" and `message`; a status_code makes it an HTTP error (a timeout's 503)."""

    rid: str | None = None
    abort_all: bool = False
    exact: bool = False
    message: str = "aborted by request"
    status_code: int | None = None


@dataclass
class ShutdownRequest:
    pass


@dataclass
class ControlRequest:
    """A request about the scheduler itself, answered by a ControlResult with the same rid."""

    rid: str
    # "check_kv_invariant" | "flush_cache" | "get_stats" | "get_internal_state" | "set_internal_state"
    # | "slow_down"
    command: str
    args: dict[str, Any] = field(default_factory=dict)


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
    # Set when the abort is the request's fault (e.g. an invalid grammar): the HTTP status to answer.
    status_code: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type, "matched": self.matched}
        if self.message is not None:
            out["message"] = self.message
        return out


@dataclass
class DetokenizeParams:
    """How the detokenizer turns one request's ids into text; travels with each of its outputs."""

    stop: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    spaces_between_special_tokens: bool = True


@dataclass
class TokenLogprobs:
    """Logprobs for a run of output tokens: the chosen token's, and the top alternatives'."""

    logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    # Per position, the logprobs of the request's token_ids_logprob (empty when it named none).
    id_logprobs: list[list[float]] = field(default_factory=list)

    def extend(self, other: TokenLogprobs) -> None:
        self.logprobs += other.logprobs
        self.top_ids += other.top_ids
        self.top_logprobs += other.top_logprobs
        self.id_logprobs += other.id_logprobs

    def since(self, start: int) -> TokenLogprobs:
        return TokenLogprobs(
            self.logprobs[start:], self.top_ids[start:], self.top_logprobs[start:], self.id_logprobs[start:]
        )

    def copy(self) -> TokenLogprobs:
        return self.since(0)


@dataclass
class ReqOutput:
    """What the scheduler emits for one request after a step: the new tokens, and the end if reached."""

    rid: str
    new_token_ids: list[int]
    finished_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    detokenize: DetokenizeParams = field(default_factory=DetokenizeParams)
    logprobs: TokenLogprobs | None = None
    # Prompt tokens' logprobs, from max(logprob_start_len, 1) on; sent once, with the first output.
    input_logprobs: TokenLogprobs | None = None
    # Embedding models: the request's embedding (its only output).
    embedding: list[float] | None = None
    # With return_hidden_states: one vector per new token, and (once, with the first output) one
    # per prompt position but the last.
    hidden_states: list[list[float]] | None = None
    prompt_hidden_states: list[list[float]] | None = None
    # With the first output: when the scheduler took the request (time.monotonic(), one clock for
    # the machine's processes) and whether it was idle then (Req.received_at), for the request
    # trace (--record-trace).
    received_at: float | None = None
    received_idle: bool = False
    # With the first output: when the scheduler sent it, on the same clock. The request trace's
    # scheduler-side time to first token, which the simulator predicts (the engine's adds the
    # hops from the scheduler through the detokenizer).
    first_output_at: float | None = None


@dataclass
class OutputBatch:
    """Everything the scheduler produced in one step, sent as one message."""

    outputs: list[ReqOutput]


@dataclass
class TextOutput:
    """One request's progress as text: what the detokenizer sends on to the engine."""

    rid: str
    text_delta: str
    new_token_ids: list[int]
    finished_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: TokenLogprobs | None = None
    input_logprobs: TokenLogprobs | None = None
    embedding: list[float] | None = None
    hidden_states: list[list[float]] | None = None
    prompt_hidden_states: list[list[float]] | None = None
    received_at: float | None = None  # as in ReqOutput
    received_idle: bool = False
    first_output_at: float | None = None


@dataclass
class TextBatch:
    outputs: list[TextOutput]


SchedulerInput = GenerateRequest | AbortRequest | ControlRequest | ShutdownRequest
SchedulerOutput = ReqOutput | ControlResult


@dataclass
class SchedulerReady:
    """The scheduler process's first message: the model is loaded and the KV cache sized."""

    max_total_tokens: int
    context_len: int
    vocab_size: int
    # The model answers embedding requests only (an encoder, or a decoder under --is-embedding).
    is_embedding: bool = False
    hidden_size: int = 0


@dataclass
class SchedulerFailed:
    """The scheduler process's last message when it dies of an error."""

    error: str
