from __future__ import annotations

import torch

from radixserve.model.sampler import SamplingBatch, sample
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
