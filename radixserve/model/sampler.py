"""Sampler: turns a batch of logits into next tokens, one set of sampling parameters per row.

Order of operations on a row's raw logits: stop tokens masked (before min_new_tokens), repetition
penalty (HF's: positive logits divided, negative multiplied, for tokens in the prompt or output),
frequency and presence penalties (OpenAI's: minus freq × count minus presence × [count > 0], over
output tokens), logit_bias added, tokens the row's grammar forbids masked; then greedy argmax, or
temperature → min_p → top_k → top_p → draw. Logprobs are taken from the raw logits, before any of this.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.sampling_params import SamplingParams


@dataclass
class SamplingBatch:
    """Per-row parameters as tensors, built once per batch so that sampling stays vectorized."""

    temperatures: torch.Tensor  # [B, 1]
    top_ps: torch.Tensor  # [B]
    top_ks: torch.Tensor  # [B], vocab size where top_k is off
    min_ps: torch.Tensor  # [B]
    generators: list[torch.Generator | None]
    all_greedy: bool
    greedy_rows: torch.Tensor  # [B] bool
    need_top_p: bool
    need_top_k: bool
    need_min_p: bool
    # (rows, token ids) whose logits are masked out this step: stop tokens before min_new_tokens.
    banned: tuple[torch.Tensor, torch.Tensor] | None = None
    penalties: Penalties | None = None
    # (rows, token ids) and the values added there.
    logit_bias: tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    # [B, V] bool: the tokens a grammar allows each row (None: no row is constrained).
    allowed: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        vocab_size: int,
        device: torch.device,
        banned_ids: list[list[int]] | None = None,
        histories: list[tuple[list[int], list[int]]] | None = None,
        allowed: torch.Tensor | None = None,
    ) -> SamplingBatch:
        """histories: each row's (prompt ids, output ids); needed only when a row has penalties."""
        greedy = [p.is_greedy for p in params]
        banned = None
        if banned_ids is not None and any(banned_ids):
            banned = _row_token_pairs(banned_ids, device)
        penalties = None
        if any(p.has_penalties for p in params):
            if histories is None:
                raise ValueError("penalties need each row's prompt and output ids")
            penalties = Penalties.build(params, histories, vocab_size, device)
        logit_bias = None
        if any(p.logit_bias for p in params):
            biases = [[(int(t), b) for t, b in p.logit_bias.items()] for p in params]
            index = _row_token_pairs([[t for t, _ in row] for row in biases], device)
            values = torch.tensor([b for row in biases for _, b in row], dtype=torch.float32, device=device)
            logit_bias = (index, values)
        top_ks = [p.top_k if p.top_k > 0 else vocab_size for p in params]
        return cls(
            temperatures=torch.tensor(
                [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)],
                dtype=torch.float32,
                device=device,
            ).unsqueeze(1),
            top_ps=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            top_ks=torch.tensor(top_ks, dtype=torch.int64, device=device),
            min_ps=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
            generators=generators,
            all_greedy=all(greedy),
            greedy_rows=torch.tensor(greedy, dtype=torch.bool, device=device),
            need_top_p=any(p.top_p < 1.0 for p in params),
            need_top_k=any(k < vocab_size for k in top_ks),
            need_min_p=any(p.min_p > 0.0 for p in params),
            banned=banned,
            penalties=penalties,
            logit_bias=logit_bias,
            allowed=allowed,
        )


def _row_token_pairs(ids_per_row: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [row for row, ids in enumerate(ids_per_row) for _ in ids]
    cols = [t for ids in ids_per_row for t in ids]
    return (
        torch.tensor(rows, dtype=torch.int64, device=device),
        torch.tensor(cols, dtype=torch.int64, device=device),
    )


@dataclass
class Penalties:
    frequency: torch.Tensor  # [B, 1]
    presence: torch.Tensor  # [B, 1]
    repetition: torch.Tensor  # [B, 1], 1.0 = off
    output_counts: torch.Tensor  # [B, V] float32: how often each token was output
    seen: torch.Tensor | None  # [B, V] bool: in the prompt or the output (for repetition only)

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        histories: list[tuple[list[int], list[int]]],
        vocab_size: int,
        device: torch.device,
    ) -> Penalties:
        def column(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)

        outputs = [out for _, out in histories]
        output_counts = _token_counts(outputs, vocab_size, device)
        seen = None
        if any(p.repetition_penalty != 1.0 for p in params):
            prompts = [prompt for prompt, _ in histories]
            seen = (_token_counts(prompts, vocab_size, device) > 0) | (output_counts > 0)
        return cls(
            frequency=column([p.frequency_penalty for p in params]),
            presence=column([p.presence_penalty for p in params]),
            repetition=column([p.repetition_penalty for p in params]),
            output_counts=output_counts,
            seen=seen,
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.seen is not None:
            factor = torch.where(self.seen, self.repetition, 1.0)
            logits = torch.where(logits > 0, logits / factor, logits * factor)
        counts = self.output_counts
        return logits - self.frequency * counts - self.presence * (counts > 0).float()


def _token_counts(rows: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[len(rows), vocab_size] float32 occurrence counts, in one scatter_add."""
    width = max(1, max((len(r) for r in rows), default=1))
    # Padding goes to an extra column that is cut off afterwards.
    padded = torch.full((len(rows), width), vocab_size, dtype=torch.int64)
    for i, ids in enumerate(rows):
        if ids:
            padded[i, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
    padded = padded.to(device)
    counts = torch.zeros(len(rows), vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab_size]


def adjust_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The logits sampling works on: masks, penalties and biases applied (never in place)."""
    if batch.banned is not None:
        logits = logits.index_put(batch.banned, torch.tensor(float("-inf"), device=logits.device))
    if batch.penalties is not None:
        logits = batch.penalties.apply(logits)
    if batch.logit_bias is not None:
        index, values = batch.logit_bias
        logits = logits.index_put(index, values, accumulate=True)
    if batch.allowed is not None:
        logits = logits.masked_fill(~batch.allowed, float("-inf"))
    return logits


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, rows: list[int], top_k: int
) -> list[tuple[float, list[int], list[float]]]:
    """For each row in rows: the logprob of its token under the raw logits, and the top_k
    (ids, logprobs). One log_softmax and one topk for all rows."""
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
    chosen = logprobs.gather(1, tokens.index_select(0, index).unsqueeze(1)).squeeze(1).tolist()
    if top_k > 0:
        top = logprobs.topk(top_k, dim=-1)
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
    else:
        top_values, top_ids = [[] for _ in rows], [[] for _ in rows]
    return list(zip(chosen, top_ids, top_values, strict=True))


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits: [B, V] float32. Returns int64 token ids [B]."""
    logits = adjust_logits(logits, batch)
    greedy_ids = logits.argmax(dim=-1)
    if batch.all_greedy:
        return greedy_ids
    probs = torch.softmax(logits / batch.temperatures, dim=-1)
    probs = _filter_probs(probs, batch)
    sampled = _draw(probs, batch.generators)
    return torch.where(batch.greedy_rows, greedy_ids, sampled)


def _filter_probs(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    if batch.need_min_p:
        # min_p keeps tokens whose probability is at least min_p times the most likely one's.
        threshold = probs.max(dim=-1, keepdim=True).values * batch.min_ps.unsqueeze(1)
        probs = probs.masked_fill(probs < threshold, 0.0)
    if batch.need_top_k or batch.need_top_p:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        if batch.need_top_k:
            ranks = torch.arange(probs.shape[-1], device=probs.device).unsqueeze(0)
            sorted_probs = sorted_probs.masked_fill(ranks >= batch.top_ks.unsqueeze(1), 0.0)
        if batch.need_top_p:
            total = sorted_probs.sum(dim=-1, keepdim=True)
            # Keep the smallest set of top tokens whose mass reaches top_p (the first always stays).
            mass_before = (sorted_probs.cumsum(dim=-1) - sorted_probs) / total
            sorted_probs = sorted_probs.masked_fill(mass_before >= batch.top_ps.unsqueeze(1), 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return probs


def _draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    # Rows with their own seed draw from their own generator, so the result does not depend
    # on which other requests share the batch.
    if all(g is None for g in generators):
        return torch.multinomial(probs, 1).squeeze(1)
    out = torch.empty(probs.shape[0], dtype=torch.int64, device=probs.device)
    for row, gen in enumerate(generators):
        out[row] = torch.multinomial(probs[row], 1, generator=gen)[0]
    return out
