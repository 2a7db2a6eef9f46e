"""Keeping the schedulers of a tensor-parallel model in step.

Every rank runs the same scheduler over its shard of the weights, and their forwards meet in
collectives, so every rank must build the same batches in the same order. They do when they see
the same inputs: rank 0 alone receives from the engine and shares each step's messages; the few
decisions that hang on timing (is a grammar compiled yet?) are rank 0's to take and share; and
rank 0 samples for all (ModelRunner.sample). Messages cross as msgpack bytes in a uint8 tensor.
"""

from __future__ import annotations

import msgspec
import torch

from radixserve.distributed.parallel import SINGLE, ParallelContext, broadcast_from_leader, min_over_ranks
from radixserve.protocol.ipc import decode, encode
from radixserve.protocol.messages import SchedulerInput

_frames_decoder = msgspec.msgpack.Decoder(list[list[bytes]])


class RankSync:
    def __init__(self, parallel: ParallelContext = SINGLE):
        self.parallel = parallel

    @property
    def is_leader(self) -> bool:
        return self.parallel.is_leader

    def share_messages(self, messages: list[SchedulerInput]) -> list[SchedulerInput]:
        """Rank 0's messages on every rank (the others pass an empty list)."""
        if self.parallel.world_size == 1:
            return messages
        payload = self._share_bytes(msgspec.msgpack.encode([encode(m) for m in messages]))
        return [decode(frames) for frames in _frames_decoder.decode(payload)]

    def agree(self, values: list[int]) -> list[int]:
        """Rank 0's values on every rank."""
        if self.parallel.world_size == 1:
            return values
        shared: list[int] = self._share_tensor(torch.tensor(values, dtype=torch.int64)).tolist()
        return shared

    def least(self, values: list[int]) -> list[int]:
        """Each value's smallest over the ranks (what every rank has: loaded pages, say)."""
        return min_over_ranks(values, self.parallel)

    def _share_bytes(self, data: bytes) -> bytes:
        return self._share_tensor(torch.frombuffer(bytearray(data), dtype=torch.uint8)).numpy().tobytes()

    def _share_tensor(self, local: torch.Tensor) -> torch.Tensor:
        size = broadcast_from_leader(
            torch.tensor([local.numel()], dtype=torch.int64), self.parallel, cpu=True
        )
        out = local if self.is_leader else torch.empty(int(size.item()), dtype=local.dtype)
        if out.numel():
            broadcast_from_leader(out, self.parallel, cpu=True)
        return out
