"""Sampler: turns a batch of logits into next tokens, one set of sampling parameters per row.

Order of operations on a row's raw logits: stop tokens masked (before min_new_tokens), repetition
penalty (HF's: positive logits divided, negative multiplied, for tokens in the prompt or output),
frequency and presence penalties (OpenAI's: minus freq × count minus presence × [count > 0], over
output tokens), logit_bias added, tokens the row's grammar forbids masked; then greedy argmax, or
temperature → min_p → top_k → top_p → draw. Logprobs are taken from the raw logits, before any of this.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from radixserve.forward.host_tensors import list_tensor
from radixserve.protocol.sampling_params import SamplingParams

if TYPE_CHECKING:
    from radixserve.kernels.cpu_ops import CpuKernels


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
    filtering_rows: torch.Tensor  # [B] bool: rows with top-k, top-p or min-p
    vocab_size: int
    # (rows, token ids) whose logits are masked out this step: stop tokens before min_new_tokens.
    banned: tuple[torch.Tensor, torch.Tensor] | None = None
    penalties: Penalties | None = None
    # (rows, token ids) and the values added there.
    logit_bias: tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    # [B, V] bool: the tokens a grammar allows each row (None: no row is constrained).
    allowed: torch.Tensor | None = None
    # [B, 1]: each row's uniform number, when the caller drew them (speculative decoding draws a
    # seeded request's per output position); None: drawn here, one per row.
    uniforms: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        vocab_size: int,
        device: torch.device,
        banned_ids: list[list[int]] | None = None,
        histories: Callable[[], list[tuple[list[int], list[int]]]] | None = None,
        allowed: torch.Tensor | None = None,
        uniforms: torch.Tensor | None = None,
        rows: Sequence[SamplingRow] | None = None,
    ) -> SamplingBatch:
        """histories: gives each row's (prompt ids, output ids); called only when a row has
        penalties. rows: SamplingRow.of(params[i]) for each row, when the caller keeps them
        (the scheduler keeps each request's: Req.sampling_row)."""
        if rows is None:
            rows = [SamplingRow.of(p) for p in params]
        # Columns, and the batch's flags from them at C speed: this runs on every step for every
        # sampling row (a 256-row batch spent 0.2 ms here when each was worked out per row).
        columns = tuple(zip(*rows, strict=True)) or ((),) * len(SamplingRow._fields)
        temperatures, top_ps, raw_top_ks, min_ps, greedy, nucleus, penalized, biased = columns
        top_ks = [k if k > 0 else vocab_size for k in raw_top_ks]
        need_top_k = min(top_ks, default=vocab_size) < vocab_size
        # Without a top-k row, filtering is the rows' own top-p / min-p flag.
        filtering = (
            [n or k < vocab_size for n, k in zip(nucleus, top_ks, strict=True)] if need_top_k else nucleus
        )
        banned = None
        if banned_ids is not None and any(banned_ids):
            banned = _row_token_pairs(banned_ids, device)
        penalties = None
        if any(penalized):
            if histories is None:
                raise ValueError("penalties need each row's prompt and output ids")
            penalties = Penalties.build(params, histories(), vocab_size, device)
        logit_bias = None
        if any(biased):
            biases = [[(int(t), b) for t, b in p.logit_bias.items()] for p in params]
            index = _row_token_pairs([[t for t, _ in row] for row in biases], device)
            values = list_tensor([b for row in biases for _, b in row], torch.float32, device)
            logit_bias = (index, values)
        return cls(
            temperatures=list_tensor(temperatures, torch.float32, device).unsqueeze(1),
            top_ps=list_tensor(top_ps, torch.float32, device),
            top_ks=list_tensor(top_ks, torch.int64, device),
            min_ps=list_tensor(min_ps, torch.float32, device),
            generators=generators,
            all_greedy=all(greedy),
            greedy_rows=list_tensor(greedy, torch.bool, device),
            need_top_p=min(top_ps, default=1.0) < 1.0,
            need_top_k=need_top_k,
            need_min_p=max(min_ps, default=0.0) > 0.0,
            filtering_rows=list_tensor(filtering, torch.bool, device),
            vocab_size=vocab_size,
            banned=banned,
            penalties=penalties,
            logit_bias=logit_bias,
            allowed=allowed,
            uniforms=uniforms,
        )


class SamplingRow(NamedTuple):
    """What a batch's tensors and flags take from one row's SamplingParams. Its sampling fields
    do not change once a request is admitted, so the scheduler works this out once per request
    instead of on every step (SamplingParams' properties cost a call each)."""

    temperature: float  # 1.0 for a greedy row: its logits are not scaled
    top_p: float
    top_k: int  # as given: -1 where top-k is off (the batch puts the vocabulary size there)
    min_p: float
    greedy: bool
    nucleus: bool  # top-p or min-p filters the row (top-k's part needs the vocabulary size)
    penalized: bool
    biased: bool  # has a logit_bias

    @classmethod
    def of(cls, params: SamplingParams) -> SamplingRow:
        greedy = params.is_greedy
        return cls(
            1.0 if greedy else params.temperature,
            params.top_p,
            params.top_k,
            params.min_p,
            greedy,
            params.top_p < 1.0 or params.min_p > 0.0,
            params.has_penalties,
            bool(params.logit_bias),
        )


def _row_token_pairs(ids_per_row: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [row for row, ids in enumerate(ids_per_row) for _ in ids]
    cols = [t for ids in ids_per_row for t in ids]
    return list_tensor(rows, torch.int64, device), list_tensor(cols, torch.int64, device)


@dataclass
class Penalties:
    """Sparse: only the (row, token) pairs that occurred are touched, never the whole [B, V]."""

    # (rows, tokens) of every distinct output token, its count, and the row's two penalties there.
    output_index: tuple[torch.Tensor, torch.Tensor]
    output_penalty: torch.Tensor  # freq × count + presence, per pair
    # (rows, tokens) of every distinct prompt-or-output token of rows with a repetition penalty.
    seen_index: tuple[torch.Tensor, torch.Tensor] | None
    seen_factor: torch.Tensor | None  # the row's repetition penalty, per pair

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        histories: list[tuple[list[int], list[int]]],
        vocab_size: int,
        device: torch.device,
    ) -> Penalties:
        frequency = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32)
        presence = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32)
        rows, tokens, counts = _distinct_tokens([out for _, out in histories], vocab_size)
        penalty = frequency[rows] * counts + presence[rows]
        seen_index = seen_factor = None
        repeating = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        if repeating:
            seen = [histories[i][0] + histories[i][1] for i in repeating]
            local_rows, seen_tokens, _ = _distinct_tokens(seen, vocab_size)
            seen_rows = torch.tensor(repeating, dtype=torch.int64)[local_rows]
            factors = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32)
            seen_index = (seen_rows.to(device), seen_tokens.to(device))
            seen_factor = factors[seen_rows].to(device)
        return cls(
            output_index=(rows.to(device), tokens.to(device)),
            output_penalty=penalty.to(device),
            seen_index=seen_index,
            seen_factor=seen_factor,
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.seen_index is not None and self.seen_factor is not None:
            values = logits[self.seen_index]
            factor = self.seen_factor
            logits = logits.index_put(
                self.seen_index, torch.where(values > 0, values / factor, values * factor)
            )
        return logits.index_put(self.output_index, -self.output_penalty, accumulate=True)


def _distinct_tokens(
    rows: list[list[int]], vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row, token, count) of every distinct token of every row, from one torch.unique."""
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    flat = torch.tensor([t for r in rows for t in r], dtype=torch.int64)
    keys = torch.repeat_interleave(torch.arange(len(rows)), lengths) * vocab_size + flat
    distinct, counts = torch.unique(keys, return_counts=True)
    return distinct // vocab_size, distinct % vocab_size, counts.to(torch.float32)


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


def sample(logits: torch.Tensor, batch: SamplingBatch, kernels: CpuKernels | None = None) -> torch.Tensor:
    """logits: [B, V] float32. Returns int64 token ids [B]."""
    logits = adjust_logits(logits, batch)
    # The first maximal index, as argmax gives: natively in one pass, else max(), which is faster
    # than argmax on a CPU.
    greedy_ids = None if kernels is None else kernels.argmax_rows(logits)
    if greedy_ids is None:
        greedy_ids = logits.max(dim=-1).indices
    if batch.all_greedy:
        return greedy_ids
    scaled = logits / batch.temperatures
    # One number per row, drawn before anything else, so that which path a row takes below (or
    # which rows share its batch) never changes the number it gets.
    uniform = _uniforms(batch.generators, scaled.device) if batch.uniforms is None else batch.uniforms
    filtering = batch.filtering_rows
    sampled = greedy_ids
    if not bool(filtering.all()):
        # Plain temperature sampling: the whole vocabulary, in vocabulary order.
        sampled = _invert_cdf(torch.softmax(scaled, dim=-1), uniform)
    if bool(filtering.any()):
        lse = torch.logsumexp(scaled, dim=-1, keepdim=True)
        ranked = _draw_filtered(scaled, lse, batch, uniform)
        sampled = torch.where(filtering, ranked, sampled)
    return torch.where(batch.greedy_rows, greedy_ids, sampled)


# Most nuclei are small: look for a row's top-k/top-p/min-p tokens among this many most likely ones
# first, and sort the whole vocabulary only when they do not hold them all (a top-k over 49k logits
# costs about twice as much at 256 candidates as at 64, and a full sort much more).
FIRST_CANDIDATES = 64


def _draw_filtered(
    scaled: torch.Tensor, lse: torch.Tensor, batch: SamplingBatch, uniform: torch.Tensor
) -> torch.Tensor:
    """Rows with top-k, top-p or min-p: one draw among their kept tokens, ranked by probability."""
    vocab = scaled.shape[-1]
    largest_k = int(batch.top_ks[batch.top_ks < vocab].max()) if batch.need_top_k else 0
    values, order = scaled.topk(min(vocab, max(FIRST_CANDIDATES, largest_k)), dim=-1)
    kept = _kept_probs(values, lse, batch, complete=values.shape[-1] == vocab)
    if kept is None:
        values, order = scaled.sort(dim=-1, descending=True)
        kept = _kept_probs(values, lse, batch, complete=True)
        assert kept is not None
    return order.gather(1, _invert_cdf(kept, uniform).unsqueeze(1)).squeeze(1)


def _kept_probs(
    ranked: torch.Tensor, lse: torch.Tensor, batch: SamplingBatch, complete: bool
) -> torch.Tensor | None:
    """The probabilities min-p, top-k and top-p keep of each row's most likely tokens (ranked:
    scaled logits in descending order); None when a filtering row may keep a token beyond them."""
    probs = (ranked - lse).exp()
    limited = batch.top_ks < batch.vocab_size
    min_p_rows = batch.min_ps > 0
    # Top-k keeps at most the candidates (there are at least as many as the largest top_k).
    covered = limited.clone()
    if batch.need_min_p:
        # min_p keeps tokens at least min_p times as likely as the most likely one; all of them
        # are among the candidates when the last candidate is already below that.
        below = probs < probs[:, :1] * batch.min_ps.unsqueeze(1)
        probs = probs.masked_fill(below, 0.0)
        covered |= min_p_rows & below[:, -1]
    kept = _top_k_mask(probs, batch)
    # Top-p renormalizes over what top-k or min-p kept; with neither, over the whole row (mass 1).
    totals = torch.where(limited | min_p_rows, kept.sum(-1), torch.ones_like(batch.top_ps))
    if batch.need_top_p:
        reached = kept.sum(-1) >= batch.top_ps * totals
        covered |= ~min_p_rows & (batch.top_ps < 1.0) & reached
        mass_before = (kept.cumsum(dim=-1) - kept) / totals.unsqueeze(1)
        kept = kept.masked_fill(mass_before >= batch.top_ps.unsqueeze(1), 0.0)
    if not complete and not bool((covered | ~batch.filtering_rows).all()):
        return None
    return kept


def _top_k_mask(sorted_probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    if not batch.need_top_k:
        return sorted_probs
    ranks = torch.arange(sorted_probs.shape[-1], device=sorted_probs.device).unsqueeze(0)
    return sorted_probs.masked_fill(ranks >= batch.top_ks.unsqueeze(1), 0.0)


def _uniforms(generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """[B, 1] uniform numbers; rows with their own seed draw from their own generator, so their
    result does not depend on which other requests share the batch."""
    if all(g is None for g in generators):
        return torch.rand(len(generators), 1, device=device)
    return torch.cat([torch.rand(1, 1, device=device, generator=gen) for gen in generators])


def _invert_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One index per row, with probability proportional to probs, by inverting each row's CDF at
    its uniform number. This needs B random numbers instead of B × vocab: torch.multinomial and
    noise-based tricks spend much of a CPU decode step on random numbers alone."""
    cdf = probs.cumsum(dim=-1)
    # The first index whose cumulative mass exceeds the draw; zero-probability ones never qualify.
    picked = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).squeeze(1)
    return picked.clamp_(max=probs.shape[-1] - 1)
