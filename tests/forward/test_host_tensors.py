from __future__ import annotations

import random

import pytest
import torch

from radixserve.forward.host_tensors import list_tensor

CPU = torch.device("cpu")


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32, torch.bool])
def test_list_tensor_equals_torch_tensor(dtype: torch.dtype) -> None:
    rng = random.Random(0)
    values: list[int] | list[float] | list[bool]
    if dtype is torch.bool:
        values = [rng.random() < 0.5 for _ in range(300)]
    elif dtype is torch.float32:
        # Doubles that float32 must round (and ints, which a float column may hold).
        values = [rng.uniform(-1e6, 1e6) for _ in range(300)] + [0.1, 1 / 3, 1e-5, 1e-45, 2, -7]
    else:
        bound = 2**62 if dtype is torch.int64 else 2**30
        values = [rng.randint(-bound, bound) for _ in range(300)] + [True, False]
    expected = torch.tensor(values, dtype=dtype)
    got = list_tensor(values, dtype, CPU)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert torch.equal(got, expected)


def test_list_tensor_of_nothing_and_of_tuples() -> None:
    assert list_tensor([], torch.int64, CPU).shape == (0,)
    assert torch.equal(list_tensor((3, 1, 2), torch.int64, CPU), torch.tensor([3, 1, 2]))
