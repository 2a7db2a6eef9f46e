"""From one forward's logits to the next token of every request that samples in this step: custom
logit processors, penalties, grammar masks and sampling (layers/sampler.py), then the logprobs and
hidden states the requests asked for."""

from __future__ import annotations

from collections.abc import Callable

import torch

from radixserve.layers.sampler import SamplingBatch
from radixserve.protocol.messages import FinishReason
from radixserve.scheduler.logit_processors import apply_processors
from radixserve.scheduler.logprobs import record_output_logprobs
from radixserve.scheduler.request import Req

Sampler = Callable[[torch.Tensor, SamplingBatch], torch.Tensor]
GrammarMask = Callable[[list[Req], torch.device], torch.Tensor | None]


def pick_next_tokens(
    reqs: list[Req],
    logits: torch.Tensor,
    hidden: torch.Tensor,
    vocab_size: int,
    sample: Sampler,
    grammar_mask: GrammarMask,
) -> list[int]:
    """logits, hidden: one row per request of reqs, in order. Returns one token id per request.

    This runs on every step for every sampling request, so the work of an option no request of
    the batch uses (logit processors, min_new_tokens, penalties, grammars, logprobs, hidden states)
    is skipped on one look at the batch."""
    params = [r.sampling_params for r in reqs]
    processors = [r.logit_processor for r in reqs]
    processed = logits
    if any(p is not None for p in processors):
        applied = apply_processors(logits, processors, [p.custom_params for p in params])
        processed = applied.logits
        for req, error in zip(reqs, applied.errors, strict=True):
            if error is not None:
                # The processor is the request's own choice: its failure ends that request only.
                req.finished_reason = FinishReason("abort", message=f"custom logit processor failed: {error}")
    sampling = SamplingBatch.build(
        params,
        [r.generator for r in reqs],
        vocab_size,
        logits.device,
        # Stop tokens are banned only before min_new_tokens.
        banned_ids=[r.banned_token_ids() for r in reqs] if any(p.min_new_tokens for p in params) else None,
        histories=lambda: [(r.penalized_prompt_ids, r.output_ids) for r in reqs],
        allowed=grammar_mask(reqs, logits.device),
        rows=[r.sampling_row for r in reqs],
    )
    next_tokens = sample(processed, sampling)
    # Logprobs are those of the raw model, before any processing.
    record_output_logprobs(reqs, logits, next_tokens)
    if any(r.return_hidden_states for r in reqs):
        for req, vector in zip(reqs, hidden[: len(reqs)], strict=True):
            if req.return_hidden_states and req.sampling_params.max_new_tokens > 0:
                req.hidden_states.append(vector.float().tolist())
    ids: list[int] = next_tokens.tolist()
    return ids


def record_prompt_hidden_states(reqs: list[Req], hidden: torch.Tensor) -> None:
    """hidden: the rows of every request's prompt_hidden_positions, in batch order."""
    row = 0
    for req in reqs:
        if req.prompt_hidden_positions is None:
            continue
        first, end = req.prompt_hidden_positions
        req.prompt_hidden_states += hidden[row : row + end - first].float().tolist()
        row += end - first
        req.prompt_hidden_positions = None
