"""How --pp-size splits a model's layers into stages: contiguous, covering every layer once, the
first stages taking one more where the split is uneven."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from radixserve.distributed.parallel import ParallelContext, stage_layers


def test_thirty_layers_over_four_stages() -> None:
    stages = [stage_layers(30, ParallelContext(pp_rank=r, pp_size=4)) for r in range(4)]
    assert stages == [range(0, 8), range(8, 16), range(16, 23), range(23, 30)]


@given(st.integers(min_value=1, max_value=200), st.integers(min_value=1, max_value=16))
def test_every_layer_lands_in_exactly_one_stage(layers: int, stages: int) -> None:
    if layers < stages:
        with pytest.raises(ValueError, match="cannot be split"):
            stage_layers(layers, ParallelContext(pp_size=stages))
        return
    parts = [stage_layers(layers, ParallelContext(pp_rank=r, pp_size=stages)) for r in range(stages)]
    assert [i for part in parts for i in part] == list(range(layers))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
