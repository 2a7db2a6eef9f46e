"""Speculative sampling keeps the target model's output distribution (chi-square, seeded draws).

The fake model here is a Markov chain over six tokens: every position's logits depend only on the
token there, so the exact distribution of any output sequence is a product of transition
probabilities. Prompts cycle through the tokens, so the n-gram index drafts the cycle's next token,
which the chain follows about half the time: drafts are accepted and rejected in roughly equal
measure. As a STANDALONE draft model, the same chain drafts greedily (mostly the cycle's next token
too). Each request samples four tokens with its own seed, so the test is deterministic (it
cannot flake); its significance threshold is small enough that a correct sampler passes for any
seeds with overwhelming probability, while a sampler that favoured drafts or drew from the wrong
row would be off by far more than chance allows at this sample size.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from radixserve.config.server_args import ServerArgs
from radixserve.forward.batch import ForwardBatch
from radixserve.protocol.messages import GenerateRequest
from radixserve.protocol.sampling_params import SamplingParams
from radixserve.scheduler.scheduler import Scheduler
from tests.scheduler.fake_executor import HIDDEN_SIZE, FakeExecutor, Results, run_until_idle

VOCAB = 6
NEW_TOKENS = 4
DRAWS = 3000
# Rejected only if the draws are this unlikely under the exact distribution.
SIGNIFICANCE = 1e-6
PROMPT = [0, 1, 2, 3, 4, 5] * 3 + [0, 1]


def _transitions() -> torch.Tensor:
    """[VOCAB, VOCAB] logits: from token a, the cycle's next token a + 1 has about half the mass."""
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(VOCAB, VOCAB, generator=generator) * 0.7
    for a in range(VOCAB):
        logits[a, (a + 1) % VOCAB] += 2.0
    return logits


class MarkovExecutor(FakeExecutor):
    """The fake executor's KV bookkeeping checks, with logits of a Markov chain."""

    def forward(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        contexts, rows = self._run(batch)
        table = _transitions()
        sampled = [rows[r] for r in batch.sample_rows.tolist()]
        logits = torch.stack([table[contexts[segment][position]] for segment, position in sampled])
        return logits, torch.zeros(len(sampled), HIDDEN_SIZE)


def _target_probs(params: dict[str, Any]) -> torch.Tensor:
    """[VOCAB, VOCAB] next-token probabilities after temperature, top-k and top-p, as the sampler
    applies them (top-p keeps the most likely tokens until the mass before one reaches top_p)."""
    scaled = _transitions() / params.get("temperature", 1.0)
    probs = torch.softmax(scaled, dim=-1)
    ranked, order = probs.sort(dim=-1, descending=True)
    keep = torch.ones_like(ranked, dtype=torch.bool)
    if params.get("top_k", -1) > 0:
        keep[:, params["top_k"] :] = False
    kept = ranked * keep
    if params.get("top_p", 1.0) < 1.0:
        mass_before = (kept.cumsum(-1) - kept) / kept.sum(-1, keepdim=True)
        keep &= mass_before < params["top_p"]
    kept = torch.zeros_like(probs).scatter(1, order, ranked * keep)
    return kept / kept.sum(-1, keepdim=True)


def _draw(algorithm: str | None, params: dict[str, Any]) -> tuple[list[tuple[int, ...]], Any]:
    args: dict[str, Any] = {
        "disable_overlap_schedule": True,
        "max_running_requests": 256,
        "log_level": "warning",
    }
    draft = None
    if algorithm == "NGRAM":
        args |= {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 4}
    elif algorithm == "STANDALONE":
        args |= {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "markov"}
        args |= {"speculative_num_steps": 3}
        draft = MarkovExecutor(vocab_size=VOCAB, max_total_tokens=8192)
    if algorithm is not None:
        args |= {"disable_speculative_adaptive": True}  # draft every step: the test needs drafts
    executor = MarkovExecutor(vocab_size=VOCAB, max_total_tokens=8192)
    scheduler = Scheduler(ServerArgs(**args), executor, draft=draft)
    results = Results()
    for seed in range(DRAWS):
        sampling = {"max_new_tokens": NEW_TOKENS, "ignore_eos": True, "seed": seed, **params}
        results.take(
            scheduler.handle(GenerateRequest(f"r{seed}", PROMPT, SamplingParams.from_dict(sampling)))
        )
    run_until_idle(scheduler, results)
    scheduler.check_kv_invariant()
    return [tuple(results.tokens[f"r{seed}"]) for seed in range(DRAWS)], scheduler.stats


def _sequence_probs(probs: torch.Tensor) -> dict[tuple[int, ...], float]:
    """The exact probability of every output sequence (the chain starts from the prompt's end)."""
    exact = {}
    for sequence in itertools.product(range(VOCAB), repeat=NEW_TOKENS):
        p, previous = 1.0, PROMPT[-1]
        for token in sequence:
            p *= float(probs[previous, token])
            previous = token
        if p > 0:
            exact[sequence] = p
    return exact


def _chi_square_p(draws: list[tuple[int, ...]], exact: dict[tuple[int, ...], float]) -> float:
    """Goodness of fit over the sequences, the rarest pooled so that every bin expects >= 5."""
    assert all(d in exact for d in draws), "a draw the target gives probability 0"
    observed = {s: 0 for s in exact}
    for d in draws:
        observed[d] += 1
    bins_observed, bins_expected = [], []
    pool_observed, pool_expected = 0, 0.0
    for sequence, p in sorted(exact.items(), key=lambda item: -item[1]):
        expected = p * len(draws)
        if expected >= 5:
            bins_observed.append(observed[sequence])
            bins_expected.append(expected)
        else:
            pool_observed += observed[sequence]
            pool_expected += expected
    bins_observed.append(pool_observed)
    bins_expected.append(pool_expected)
    observed_t = torch.tensor(bins_observed, dtype=torch.float64)
    expected_t = torch.tensor(bins_expected, dtype=torch.float64)
    statistic = float(((observed_t - expected_t) ** 2 / expected_t).sum())
    # The chi-square survival function with len(bins) - 1 degrees of freedom.
    dof = torch.tensor((len(bins_observed) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, torch.tensor(statistic / 2, dtype=torch.float64)))


@pytest.mark.parametrize(
    ("algorithm", "params"),
    [
        ("NGRAM", {"temperature": 1.0}),
        ("NGRAM", {"temperature": 0.7, "top_k": 4}),
        ("NGRAM", {"temperature": 1.3, "top_p": 0.8}),
        ("STANDALONE", {"temperature": 0.9, "top_k": 5}),
    ],
    ids=["ngram-t1", "ngram-t0.7-topk4", "ngram-t1.3-topp0.8", "standalone-t0.9-topk5"],
)
def test_speculative_sampling_matches_the_target_distribution(algorithm: str, params: dict[str, Any]) -> None:
    exact = _sequence_probs(_target_probs(params))
    draws, stats = _draw(algorithm, params=params)
    # Drafts were both accepted and rejected often enough to matter.
    assert stats.spec_draft_tokens > DRAWS
    assert 0.2 < stats.spec_accept_rate < 0.9
    assert _chi_square_p(draws, exact) > SIGNIFICANCE
    # The same check holds without speculation (the reference computation is right).
    plain, _ = _draw(None, params=params)
    assert _chi_square_p(plain, exact) > SIGNIFICANCE
