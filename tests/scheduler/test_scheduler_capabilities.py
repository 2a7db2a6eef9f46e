"""An executor needs only the Executor core to serve generation (executor/base.py); a feature that
needs a capability it lacks is refused when the scheduler is built, or (a control command) with a
message, naming both."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from radixserve.config.server_args import ServerArgs
from radixserve.executor.base import ExecutorInfo, KVSlots, LoraSlots, MemoryControl, MissingCapabilityError
from radixserve.forward.batch import ForwardBatch
from radixserve.layers.sampler import SamplingBatch
from radixserve.protocol.messages import ControlRequest, ControlResult
from radixserve.scheduler.scheduler import Scheduler
from tests.scheduler.fake_executor import FakeExecutor, Results, expected_output, run_until_idle, submit


class CoreOnly:
    """The fake executor behind the seven members every executor has, and nothing more."""

    def __init__(self) -> None:
        self._fake = FakeExecutor()

    @property
    def info(self) -> ExecutorInfo:
        return self._fake.info

    def forward(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        return self._fake.forward(batch)

    def sample(self, logits: torch.Tensor, sampling: SamplingBatch) -> torch.Tensor:
        return self._fake.sample(logits, sampling)

    def idle(self) -> None:
        self._fake.idle()

    def close(self) -> None:
        self._fake.close()

    def describe(self) -> dict[str, Any]:
        return self._fake.describe()

    def stats(self) -> dict[str, Any]:
        return self._fake.stats()


def test_the_core_alone_serves_generation() -> None:
    executor = CoreOnly()
    assert not isinstance(executor, (KVSlots, LoraSlots, MemoryControl))
    scheduler = Scheduler(ServerArgs(log_level="warning"), executor)
    results = Results()
    submit(scheduler, results, "a", [1, 2, 3], 5)
    run_until_idle(scheduler, results)
    assert results.tokens["a"] == expected_output([1, 2, 3], 5, 1024)
    stats = scheduler.handle(ControlRequest("s", "get_stats"))[-1]
    assert isinstance(stats, ControlResult) and stats.payload["memory_released"] == []
    refused = scheduler.handle(ControlRequest("r", "release_memory_occupation", {}))[-1]
    assert isinstance(refused, ControlResult) and not refused.ok
    assert "releasing memory needs an executor with MemoryControl, which CoreOnly lacks" in str(refused.error)


@pytest.mark.parametrize(
    ("flags", "needs"),
    [
        ({"speculative_algorithm": "NGRAM"}, "--speculative-algorithm needs an executor with KVSlots"),
        (
            {"enable_lora": True, "max_lora_rank": 8, "lora_target_modules": ["q_proj"]},
            "--enable-lora needs an executor with LoraSlots",
        ),
    ],
)
def test_a_feature_without_its_capability_is_refused_at_startup(flags: dict[str, Any], needs: str) -> None:
    with pytest.raises(MissingCapabilityError, match=needs):
        Scheduler(ServerArgs(log_level="warning", **flags), CoreOnly())
