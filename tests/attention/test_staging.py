"""Decode staging keeps each bucket's K/V contiguous across steps: attention over the staged blocks
must equal attention that gathers from the pool every step, through appends, refills, requests
leaving, shared prefixes, a full block and a budget too small to stage."""

from __future__ import annotations

import pytest
import torch

from radixserve.attention.base import AttentionSpec, LayerInputs
from radixserve.attention.common import decode_shared_prefix
from radixserve.attention.staging import DecodeStaging, PrefixStaging, StagedPrefix
from radixserve.attention.torch_native import TorchNativeBackend
from radixserve.config.server_args import InvalidArgumentError, ServerArgs
from radixserve.forward.batch import DecodeLayout, build_decode_layout

LAYERS, HEADS, KV_HEADS, DIM = 2, 4, 2, 8
SLOTS = 2048


class _Run:
    """Requests decoding step by step over one pool, with and without staging."""

    def __init__(self, staging_tokens: int, prompts: list[list[int]]):
        self.k = [torch.randn(SLOTS, KV_HEADS, DIM) for _ in range(LAYERS)]
        self.v = [torch.randn(SLOTS, KV_HEADS, DIM) for _ in range(LAYERS)]
        self.table = torch.zeros(8, 512, dtype=torch.int64)
        self.lens: dict[int, int] = {}
        self.admission = list(range(8))  # per request row, as Req.admission
        self.next_slot = 1000
        for row, slots in enumerate(prompts):
            self.table[row, : len(slots)] = torch.tensor(slots)
            self.lens[row] = len(slots)
        cpu = torch.device("cpu")
        self.backend = TorchNativeBackend(
            AttentionSpec(LAYERS, HEADS, KV_HEADS, DIM, torch.float32, cpu, None, staging_tokens)
        )
        self.plain = TorchNativeBackend(
            AttentionSpec(LAYERS, HEADS, KV_HEADS, DIM, torch.float32, cpu, None, 0)
        )
        self.staging = self.backend.staging

    def readmit(self, row: int) -> None:
        """The request was retracted and admitted again: a new admission serial."""
        self.admission[row] += 100

    def step(self, rows: list[int], share_prefixes: bool = False) -> None:
        """One decode step of these request rows: the staged result must equal the gathered one."""
        indices = torch.tensor(rows)
        new_slots = torch.arange(self.next_slot, self.next_slot + len(rows))
        self.next_slot += len(rows)
        for i, row in enumerate(rows):
            self.table[row, self.lens[row]] = new_slots[i]
            self.lens[row] += 1
        lens = torch.tensor([self.lens[r] for r in rows])
        ids = [self.admission[r] for r in rows]
        layout = build_decode_layout(self.table, indices, lens, ids)
        self.backend.cascade = self.plain.cascade = share_prefixes
        staged_plan, plain_plan = self.backend.plan_decode(layout), self.plain.plan_decode(layout)
        q = torch.randn(len(rows), HEADS, DIM)
        for layer in range(LAYERS):
            new_k, new_v = torch.randn(len(rows), KV_HEADS, DIM), torch.randn(len(rows), KV_HEADS, DIM)
            self.k[layer][new_slots], self.v[layer][new_slots] = new_k, new_v
            args = (self.k[layer], self.v[layer])
            staged = self.backend.decode(LayerInputs(layer, q, new_k, new_v, *args, DIM**-0.5), staged_plan)
            plain = self.plain.decode(LayerInputs(layer, q, new_k, new_v, *args, DIM**-0.5), plain_plan)
            torch.testing.assert_close(staged, plain, atol=1e-6, rtol=1e-6)


def _fresh(first: int, n: int) -> list[int]:
    return list(range(first, first + n))


def test_appends_after_one_refill_and_refills_when_requests_change() -> None:
    torch.manual_seed(0)
    run = _Run(4096, [_fresh(0, 30), _fresh(100, 28), _fresh(200, 25), _fresh(300, 10)])
    # Lengths 30/28/25 share a bucket, 10 has its own: two buckets, masked and unmasked.
    run.step([0, 1, 2, 3])
    assert (run.staging.refills, run.staging.appends) == (2, 0)
    for _ in range(5):
        run.step([0, 1, 2, 3])
    assert (run.staging.refills, run.staging.appends) == (2, 10)
    run.step([0, 2, 3])  # request 1 left: its bucket is refilled, the other keeps appending
    assert (run.staging.refills, run.staging.appends) == (3, 11)
    run.step([0, 2, 3])
    assert (run.staging.refills, run.staging.appends) == (3, 13)
    run.readmit(3)  # request 3 was retracted and admitted again: its K/V may be other slots now
    run.step([0, 2, 3])
    assert (run.staging.refills, run.staging.appends) == (4, 14)
    run.lens[0] += 1  # request 0 took part in a mixed prefill: two tokens further, not one
    run.step([0, 2, 3])
    assert (run.staging.refills, run.staging.appends) == (5, 15)


def test_a_full_block_is_refilled_larger() -> None:
    torch.manual_seed(1)
    run = _Run(4096, [_fresh(0, 8), _fresh(100, 8)])
    run.step([0, 1])
    capacity = run.staging.staged_tokens // 2
    for _ in range(capacity + 3 - 9):
        run.step([0, 1])
    assert run.staging.refills == 2
    assert run.staging.staged_tokens // 2 > capacity


def test_shared_prefix_is_staged_once() -> None:
    torch.manual_seed(2)
    prefix = _fresh(0, 40)
    run = _Run(4096, [prefix + _fresh(100, 3), prefix + _fresh(200, 6), prefix + _fresh(300, 5)])
    for _ in range(4):
        run.step([0, 1, 2], share_prefixes=True)
    assert (run.staging.refills, run.staging.appends) == (1, 3)
    # 40 shared tokens once, plus three rows of (the longest own part, 7, + headroom).
    assert run.staging.staged_tokens == 40 + 3 * (7 + 32)


def test_buckets_over_the_budget_gather_from_the_pool() -> None:
    torch.manual_seed(3)
    run = _Run(60, [_fresh(0, 30), _fresh(100, 10)])
    for _ in range(3):
        run.step([0, 1])
    # The 10-token request's bucket fits (11 + 32 slots), the 30-token one never does.
    assert (run.staging.refills, run.staging.appends) == (1, 2)
    assert run.staging.staged_tokens == 1 * (11 + 32)


def _buffer_addresses(staging: DecodeStaging) -> set[int]:
    return {t.data_ptr() for block in staging._blocks.values() for t in block.buffers}


def test_refills_reuse_the_memory_of_blocks_no_bucket_continues() -> None:
    torch.manual_seed(4)
    prefix = _fresh(0, 40)
    run = _Run(4096, [prefix + _fresh(100, 3), prefix + _fresh(200, 6), _fresh(300, 30)])
    run.step([0, 1, 2], share_prefixes=True)
    first = _buffer_addresses(run.staging)
    for row in (0, 1, 2):
        run.readmit(row)  # every block is refilled, into the same memory
    run.step([0, 1, 2], share_prefixes=True)
    assert _buffer_addresses(run.staging) == first
    assert run.staging.refills == 4
    run.step([0, 2], share_prefixes=True)  # request 1 left: its bucket refills into its old buffers
    assert _buffer_addresses(run.staging) <= first
    run.staging.release()
    assert run.staging.staged_tokens == 0 and not run.staging._spares


def test_a_negative_budget_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="--decode-staging-tokens must be >= 0"):
        ServerArgs(decode_staging_tokens=-1)


class TestPrefixStaging:
    """The shared prefix's K/V kept between steps for the native kernel's cascade."""

    def _layout(self, table: torch.Tensor, rows: list[int], lens: list[int], ids: list[int]) -> DecodeLayout:
        return build_decode_layout(table, torch.tensor(rows), torch.tensor(lens), ids)

    @staticmethod
    def _prepare(staging: PrefixStaging, layout: DecodeLayout) -> StagedPrefix | None:
        return staging.prepare(decode_shared_prefix(layout), layout.request_ids)

    def test_kept_while_a_holder_runs_and_dropped_otherwise(self) -> None:
        table = torch.zeros(4, 128, dtype=torch.int64)
        table[:, :40] = torch.arange(40)  # every row starts with the same 40 slots
        for row in range(4):
            table[row, 40:60] = 100 + 20 * row + torch.arange(20)
        k_cache = torch.randn(200, KV_HEADS, DIM)
        v_cache = torch.randn(200, KV_HEADS, DIM)
        staging = PrefixStaging(LAYERS, KV_HEADS, DIM, torch.float32, torch.device("cpu"))

        first = self._layout(table, [0, 1], [50, 50], [10, 11])
        block = self._prepare(staging, first)
        assert block is not None and torch.equal(block.slots, torch.arange(40))
        keys, values = block.layer_kv(1, k_cache, v_cache)
        assert torch.equal(keys, k_cache[:40]) and torch.equal(values, v_cache[:40])

        # Request 11 still runs, 12 joined: the slots stayed locked, the block is reused.
        second = self._layout(table, [1, 2], [51, 45], [11, 12])
        assert self._prepare(staging, second) is block and block.filled[1]

        # None of the previous holders runs any more: the slots may hold other K/V by now.
        k_cache[:40] += 1.0
        third = self._prepare(staging, self._layout(table, [2, 3], [46, 45], [13, 14]))
        assert third is not None and third is not block
        keys, _ = third.layer_kv(1, k_cache, v_cache)
        assert torch.equal(keys, k_cache[:40])

        # No shared prefix (one request): nothing staged, and the block is let go.
        assert self._prepare(staging, self._layout(table, [3], [46], [14])) is None
        self._prepare(staging, self._layout(table, [2, 3], [47, 47], [13, 14]))
        assert staging._block is not None and not any(staging._block.filled)

    def test_a_prefix_over_the_memory_cap_is_not_staged(self) -> None:
        staging = PrefixStaging(LAYERS, KV_HEADS, DIM, torch.float32, torch.device("cpu"))
        staging.max_tokens = 30
        table = torch.zeros(2, 64, dtype=torch.int64)
        table[:, :40] = torch.arange(40)
        table[:, 40:50] = torch.stack([100 + torch.arange(10), 200 + torch.arange(10)])
        layout = self._layout(table, [0, 1], [50, 50], [1, 2])
        assert decode_shared_prefix(layout) is not None and self._prepare(staging, layout) is None
