"""From requests to ReqOutput messages, and the overlap of publishing them with the next forward.

A step's results are handled in two parts. Deciding (results.py) appends each sampled token,
advances grammars, checks stops and updates the running list: the next batch depends on it.
Publishing (here) releases the KV of finished requests into the cache and builds the outputs:
nothing in the next batch depends on it, so with the overlap schedule it runs in a helper thread
while the main thread runs the next forward (torch releases the GIL inside its kernels).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from radixserve.config.server_args import ServerArgs
from radixserve.protocol.messages import DetokenizeParams, FinishReason, ReqOutput, TokenLogprobs
from radixserve.scheduler.request import Req


@dataclass(slots=True)
class _Stream:
    """What one request has been sent: its token count, and its detokenizer settings (fixed for
    its lifetime, so built once rather than on every step)."""

    detokenize: DetokenizeParams
    sent: int = 0


class OutputBuilder:
    """Builds each request's ReqOutput from what it has not been sent yet."""

    def __init__(self) -> None:
        # One entry per request that has been sent something: a single lookup per output, as
        # this runs for every running request on every step.
        self._streams: dict[str, _Stream] = {}

    def unsent_tokens(self, req: Req) -> int:
        stream = self._streams.get(req.rid)
        return len(req.output_ids) - (0 if stream is None else stream.sent)

    def final(self, req: Req) -> ReqOutput:
        out = self.progress(req)
        self._streams.pop(req.rid, None)
        return out

    def progress(self, req: Req) -> ReqOutput:
        rid, output_ids = req.rid, req.output_ids
        stream = self._streams.get(rid)
        received_at, received_idle, first_output_at = None, False, None
        if stream is None:
            received_at, received_idle = req.received_at, req.received_idle
            first_output_at = time.monotonic()
            params = req.sampling_params
            stream = self._streams[rid] = _Stream(
                DetokenizeParams(
                    params.stop,
                    params.skip_special_tokens,
                    params.no_stop_trim,
                    params.spaces_between_special_tokens,
                )
            )
        start, stream.sent = stream.sent, len(output_ids)
        hidden = req.return_hidden_states
        return ReqOutput(
            rid,
            output_ids[start:],
            req.finished_reason,
            len(req.origin_input_ids),
            len(output_ids),
            req.cached_tokens,
            stream.detokenize,
            None if req.logprobs is None else req.logprobs.since(start),
            None if req.input_logprobs is None else _unsent_input_logprobs(req),
            req.embedding,
            req.hidden_states[start:] if hidden else None,
            _unsent_prompt_hidden_states(req) if hidden else None,
            received_at,
            received_idle,
            first_output_at,
        )

    @staticmethod
    def error(rid: str, prompt_tokens: int, message: str, status_code: int | None = None) -> ReqOutput:
        finish = FinishReason("abort", message=message, status_code=status_code)
        return ReqOutput(rid, [], finish, prompt_tokens, 0, 0)


def _unsent_prompt_hidden_states(req: Req) -> list[list[float]] | None:
    # Complete once the prompt is prefilled, which is before the first output.
    if not req.return_hidden_states or req.prompt_hidden_sent:
        return None
    req.prompt_hidden_sent = True
    return req.prompt_hidden_states


def _unsent_input_logprobs(req: Req) -> TokenLogprobs | None:
    # Complete once the prompt is prefilled, which is before the first output.
    if req.input_logprobs is None or req.input_logprobs_sent:
        return None
    req.input_logprobs_sent = True
    return req.input_logprobs


@dataclass
class Decided:
    """One step's requests to publish, in batch order: (request, whether it finished)."""

    reqs: list[tuple[Req, bool]] = field(default_factory=list)


def overlap_enabled(args: ServerArgs, device: torch.device) -> bool:
    """On by default on CUDA. Off by default on a CPU, where it measured slower (docs/parallelism.md):
    the forward's threads already use every core, so the helper only takes time from them."""
    if args.disable_overlap_schedule:
        return False
    return args.enable_overlap_schedule or device.type == "cuda"


class OverlappedPublisher:
    """Runs one publish job at a time in a helper thread; the caller joins it before it touches
    the cache or the requests again."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="radixserve-publish")

    def start(self, publish: Callable[[], list[ReqOutput]]) -> Future[list[ReqOutput]]:
        return self._pool.submit(publish)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
