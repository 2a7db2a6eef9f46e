"""Sampler: turns a batch of logits into next tokens, one set of sampling parameters per row."""

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

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        vocab_size: int,
        device: torch.device,
        banned_ids: list[list[int]] | None = None,
    ) -> SamplingBatch:
        greedy = [p.is_greedy for p in params]
        banned = None
        if banned_ids is not None and any(banned_ids):
            rows = [row for row, ids in enumerate(banned_ids) for _ in ids]
            cols = [t for ids in banned_ids for t in ids]
            banned = (
                torch.tensor(rows, dtype=torch.int64, device=device),
                torch.tensor(cols, dtype=torch.int64, device=device),
            )
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
        )


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits: [B, V] float32. Returns int64 token ids [B]."""
    if batch.banned is not None:
        logits = logits.index_put(batch.banned, torch.tensor(float("-inf"), device=logits.device))
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
