from __future__ import annotations

import torch

from radixserve.model.sampler import SamplingBatch, adjust_logits, sample
from radixserve.sampling_params import SamplingParams


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
        params, [None, None], 6, torch.device("cpu"), histories=list(zip(prompt, output, strict=True))
    )
    ours = adjust_logits(logits, batch)
    for row, p in enumerate(params):
        seq = torch.tensor([prompt[row] + output[row]])
        expected = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(seq, logits[row : row + 1].clone())
        torch.testing.assert_close(ours[row : row + 1], expected)


def test_frequency_and_presence_penalties_follow_the_openai_formula() -> None:
    logits = torch.zeros(1, 6)
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    # The prompt does not count for these two; the output has token 2 three times and token 4 once.
    batch = SamplingBatch.build([params], [None], 6, torch.device("cpu"), histories=[([1, 1], [2, 2, 4, 2])])
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
