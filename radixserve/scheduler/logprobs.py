"""Recording logprobs after a forward: of sampled tokens, and of prompt tokens.

All values come from the raw logits (before temperature, penalties and masks). Per position a request
gets its token's logprob, its top_logprobs_num best alternatives, and the logprobs of the ids it named
in token_ids_logprob. One log_softmax and one topk serve every row of the batch.
"""

from __future__ import annotations

import torch

from radixserve.protocol.messages import TokenLogprobs
from radixserve.scheduler.request import Req


def position_logprobs(logits: torch.Tensor, tokens: list[int], reqs: list[Req]) -> list[TokenLogprobs]:
    """One TokenLogprobs (a single position) per row of logits; row i belongs to reqs[i]."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(tokens, dtype=torch.int64, device=logits.device).unsqueeze(1)
    chosen = logprobs.gather(1, index).squeeze(1).tolist()
    top_k = max(r.top_logprobs_num for r in reqs)
    if top_k > 0:
        top = logprobs.topk(top_k, dim=-1)
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
    else:
        top_values, top_ids = [[] for _ in reqs], [[] for _ in reqs]
    results = []
    for row, req in enumerate(reqs):
        k = req.top_logprobs_num
        named = req.token_ids_logprob
        id_values = [logprobs[row, named].tolist()] if named else []
        results.append(TokenLogprobs([chosen[row]], [top_ids[row][:k]], [top_values[row][:k]], id_values))
    return results


def record_output_logprobs(reqs: list[Req], logits: torch.Tensor, next_tokens: torch.Tensor) -> None:
    """logits / next_tokens: one row per request of reqs (the sampling rows)."""
    rows = [i for i, r in enumerate(reqs) if r.logprobs is not None and r.sampling_params.max_new_tokens > 0]
    if not rows:
        return
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    wanted = [reqs[i] for i in rows]
    tokens = next_tokens.index_select(0, index).tolist()
    for req, found in zip(
        wanted, position_logprobs(logits.index_select(0, index), tokens, wanted), strict=True
    ):
        assert req.logprobs is not None
        req.logprobs.extend(found)


def record_input_logprobs(reqs: list[Req], logits: torch.Tensor) -> None:
    """logits: the rows of every request's input_logprob_positions, in batch order."""
    wanted = [r for r in reqs if r.input_logprob_positions is not None]
    tokens: list[int] = []
    owners: list[Req] = []
    for req in wanted:
        first, end = req.input_logprob_positions  # type: ignore[misc]
        # The logits at position p give the logprob of prompt token p + 1.
        tokens += req.origin_input_ids[first + 1 : end + 1]
        owners += [req] * (end - first)
    for req, found in zip(owners, position_logprobs(logits, tokens, owners), strict=True):
        assert req.input_logprobs is not None
        req.input_logprobs.extend(found)
    for req in wanted:
        _, end = req.input_logprob_positions  # type: ignore[misc]
        req.input_logprob_next = end + 1
        req.input_logprob_positions = None
