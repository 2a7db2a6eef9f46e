from __future__ import annotations

import pytest
import torch

from radixserve.layers.sampler import SamplingBatch, SamplingRow, _kept_probs, adjust_logits, sample
from radixserve.protocol.sampling_params import SamplingParams


def _batch(*params: SamplingParams, generators: list[torch.Generator | None] | None = None) -> SamplingBatch:
    gens = generators or [None] * len(params)
    return SamplingBatch.build(list(params), gens, vocab_size=6, device=torch.device("cpu"))


LOGITS = torch.log(torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.04, 0.01]]))


def _draws(params: SamplingParams, n: int = 400) -> set[int]:
    gen = torch.Generator().manual_seed(0)
    batch = _batch(params, generators=[gen])
    return {int(sample(LOGITS.clone(), batch)[0]) for _ in range(n)}


def test_greedy_rows_take_the_argmax() -> None:
    logits = torch.tensor([[0.1, 2.0, 0.3, 0, 0, 0], [5.0, 0.0, 0.0, 0, 0, 0]])
    batch = _batch(SamplingParams(temperature=0.0), SamplingParams(temperature=0.0))
    assert batch.all_greedy
    assert sample(logits, batch).tolist() == [1, 0]


def test_top_k_top_p_min_p_restrict_the_support() -> None:
    assert _draws(SamplingParams(top_k=2)) == {0, 1}
    # top_p 0.7: 0.4 + 0.3 reaches it, so only the two most likely tokens stay.
    assert _draws(SamplingParams(top_p=0.7)) == {0, 1}
    # min_p 0.3: keep p >= 0.12 → tokens 0, 1, 2.
    assert _draws(SamplingParams(min_p=0.3)) == {0, 1, 2}
    assert _draws(SamplingParams()) >= {0, 1, 2, 3}


def test_seeded_rows_do_not_depend_on_their_neighbours() -> None:
    def run(with_neighbour: bool) -> list[int]:
        gen = torch.Generator().manual_seed(3)
        params = [SamplingParams(seed=3)] + ([SamplingParams(temperature=0.0)] if with_neighbour else [])
        gens: list[torch.Generator | None] = [gen] + ([None] if with_neighbour else [])
        batch = _batch(*params, generators=gens)
        logits = LOGITS.repeat(len(params), 1)
        return [int(sample(logits.clone(), batch)[0]) for _ in range(20)]

    assert run(False) == run(True)


def test_mixed_greedy_and_sampled_rows() -> None:
    logits = torch.tensor([[0.0, 9.0, 0, 0, 0, 0], [0.0, 0.0, 0, 0, 0, 9.0]])
    batch = _batch(SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=1))
    assert sample(logits, batch).tolist() == [1, 5]


def test_repetition_penalty_matches_transformers() -> None:
    from transformers import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(0)
    logits = torch.randn(2, 6)
    prompt, output = [[0, 1], [5]], [[1, 3], [5, 2]]
    params = [SamplingParams(repetition_penalty=1.3), SamplingParams(repetition_penalty=0.7)]
    batch = SamplingBatch.build(
        params, [None, None], 6, torch.device("cpu"), histories=lambda: list(zip(prompt, output, strict=True))
    )
    ours = adjust_logits(logits, batch)
    for row, p in enumerate(params):
        seq = torch.tensor([prompt[row] + output[row]])
        expected = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(seq, logits[row : row + 1].clone())
        torch.testing.assert_close(ours[row : row + 1], expected)


def test_frequency_and_presence_penalties_follow_the_openai_formula() -> None:
    logits = torch.zeros(1, 6)
    params = SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.25)
    # The prompt does not count for these two; the output has token 2 three times and token 4 once.
    batch = SamplingBatch.build(
        [params], [None], 6, torch.device("cpu"), histories=lambda: [([1, 1], [2, 2, 4, 2])]
    )
    ours = adjust_logits(logits, batch)
    expected = torch.tensor([[0.0, 0.0, -(0.5 * 3 + 0.25), 0.0, -(0.5 + 0.25), 0.0]])
    torch.testing.assert_close(ours, expected)
    # Penalties change greedy choices too: token 2 would win without them.
    logits = torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0, 0.9]])
    assert int(sample(logits, batch)[0]) == 5


def test_logit_bias_and_banned_tokens() -> None:
    logits = torch.zeros(2, 6)
    params = [SamplingParams(temperature=0.0, logit_bias={"3": 5.0}), SamplingParams(temperature=0.0)]
    batch = SamplingBatch.build(params, [None, None], 6, torch.device("cpu"), banned_ids=[[3], [0]])
    adjusted = adjust_logits(logits, batch)
    assert adjusted[0, 3] == float("-inf") and adjusted[1, 0] == float("-inf")
    unbanned = SamplingBatch.build(params, [None, None], 6, torch.device("cpu"))
    assert sample(logits, unbanned).tolist()[0] == 3
    assert logits.abs().sum() == 0  # never in place


def _reference_filter(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Top-k / top-p / min-p by a full sort, one row at a time."""
    out = []
    for row, p in zip(probs, params, strict=True):
        if p.min_p > 0:
            row = row.masked_fill(row < row.max() * p.min_p, 0.0)
        values, order = row.sort(descending=True)
        if p.top_k > 0:
            values[p.top_k :] = 0.0
        if p.top_p < 1.0:
            before = (values.cumsum(0) - values) / values.sum()
            values = values.masked_fill(before >= p.top_p, 0.0)
        out.append(torch.zeros_like(row).scatter(0, order, values))
    return torch.stack(out)


def _kept_distribution(
    probs: torch.Tensor, batch: SamplingBatch, candidates: int | None
) -> torch.Tensor | None:
    """What the sampler keeps of each row, normalized, in vocabulary order (None: it would need
    more than `candidates` tokens and sort the whole row instead)."""
    scaled = torch.log(probs)
    lse = torch.logsumexp(scaled, dim=-1, keepdim=True)
    if candidates is None:
        values, order = scaled.sort(dim=-1, descending=True)
    else:
        values, order = scaled.topk(candidates, dim=-1)
    kept = _kept_probs(values, lse, batch, complete=candidates is None)
    if kept is None:
        return None
    full = torch.zeros_like(probs).scatter(-1, order, kept)
    return full / full.sum(-1, keepdim=True)


def test_candidate_filtering_equals_a_full_sort() -> None:
    torch.manual_seed(1)
    vocab = 5000
    params = [
        SamplingParams(top_p=0.9),
        SamplingParams(top_k=40, top_p=0.5),
        SamplingParams(min_p=0.05, top_p=0.95),
        SamplingParams(min_p=0.2),
        SamplingParams(top_k=600),
    ]
    batch = SamplingBatch.build(params, [None] * len(params), vocab, torch.device("cpu"))
    peaked = torch.softmax(torch.randn(len(params), vocab) * 6, dim=-1)
    # A flat row: its top_p mass lies far beyond the first candidates, forcing the full sort.
    flat = torch.softmax(torch.randn(len(params), vocab) * 0.01, dim=-1)
    for probs in (peaked, flat):
        reference = _reference_filter(probs, params)
        reference = reference / reference.sum(-1, keepdim=True)
        full = _kept_distribution(probs, batch, None)
        assert full is not None
        torch.testing.assert_close(full, reference)
        from_candidates = _kept_distribution(probs, batch, 600)
        if probs is peaked:
            assert from_candidates is not None  # these nuclei fit in the first candidates
            torch.testing.assert_close(from_candidates, reference)
        else:
            assert from_candidates is None


def test_a_seeded_row_draws_the_same_token_whichever_path_its_batch_takes() -> None:
    torch.manual_seed(3)
    vocab = 5000
    peaked = torch.randn(1, vocab) * 6
    flat = torch.randn(1, vocab) * 0.01  # top_p over it needs the full sort: the whole batch sorts
    row = SamplingParams(top_p=0.8, seed=7)
    # Alone, the row's nucleus fits in the first candidates; next to the flat row it does not.
    assert _kept_distribution(torch.softmax(peaked, -1), _batch_of([row], vocab, [7]), 64) is not None
    for step in range(5):
        alone = sample(peaked.clone(), _batch_of([row], vocab, seeds=[7 + step]))
        with_flat = sample(
            torch.cat([peaked, flat]),
            _batch_of([row, SamplingParams(top_p=0.9)], vocab, seeds=[7 + step, None]),
        )
        assert int(alone[0]) == int(with_flat[0])


def _batch_of(params: list[SamplingParams], vocab: int, seeds: list[int | None]) -> SamplingBatch:
    gens = [None if s is None else torch.Generator().manual_seed(s) for s in seeds]
    return SamplingBatch.build(params, gens, vocab, torch.device("cpu"))


def test_draws_follow_the_distribution() -> None:
    probs = torch.tensor([[0.5, 0.0, 0.3, 0.2]]).repeat(20000, 1)
    batch = SamplingBatch.build([SamplingParams()] * 20000, [None] * 20000, 4, torch.device("cpu"))
    torch.manual_seed(0)
    counts = torch.bincount(sample(torch.log(probs), batch), minlength=4).float() / 20000
    assert counts[1] == 0  # a zero-probability token is never drawn
    torch.testing.assert_close(counts, probs[0], atol=0.015, rtol=0)


def test_batch_tensors_and_flags_from_each_rows_parameters() -> None:
    vocab = 6
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=3),
        SamplingParams(top_p=0.9),
        SamplingParams(min_p=0.1),
        SamplingParams(top_k=vocab + 5),  # beyond the vocabulary: no filter
        SamplingParams(top_k=1),  # greedy, yet a top-k row
    ]
    batch = SamplingBatch.build(params, [None] * len(params), vocab, torch.device("cpu"))
    assert batch.temperatures.squeeze(1).tolist() == pytest.approx([1.0, 0.7, 1.0, 1.0, 1.0, 1.0])
    assert batch.top_ks.tolist() == [vocab, 3, vocab, vocab, vocab + 5, 1]
    assert batch.greedy_rows.tolist() == [True, False, False, False, False, True]
    assert batch.filtering_rows.tolist() == [False, True, True, True, False, True]
    assert (batch.need_top_k, batch.need_top_p, batch.need_min_p, batch.all_greedy) == (
        True,
        True,
        True,
        False,
    )
    # Without a top-k row, the filtering rows are those with top-p or min-p.
    plain = SamplingBatch.build(params[2:5], [None] * 3, vocab, torch.device("cpu"))
    assert plain.filtering_rows.tolist() == [True, True, False]
    assert not plain.need_top_k
    # Rows kept per request give the same batch.
    kept = SamplingBatch.build(
        params, [None] * len(params), vocab, torch.device("cpu"), rows=[SamplingRow.of(p) for p in params]
    )
    for name in ("temperatures", "top_ps", "top_ks", "min_ps", "greedy_rows", "filtering_rows"):
        assert torch.equal(getattr(kept, name), getattr(batch, name))
