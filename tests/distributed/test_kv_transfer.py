"""The K/V transport of prefill/decode disaggregation on loopback: a prefill side and a decode side
(a TCPStore and a gloo pair), in this process. K/V arrives bit for bit in its dtype, only for rooms
the decode side claimed; a room the decode side gave up is dropped by the prefill side; a prefill
side that closes fails the rooms still expected from it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import torch

from radixserve.distributed.kv_transfer import (
    GlooDecodeTransfer,
    GlooPrefillTransfer,
    KVHandoff,
    layout_signature,
)
from tests.ports import free_port

LAYOUT = layout_signature((3, 2, 2, 8), torch.bfloat16)
DEADLINE_S = 30.0


@pytest.fixture
def sides() -> Iterator[tuple[GlooPrefillTransfer, GlooDecodeTransfer, int]]:
    port = free_port()
    prefill = GlooPrefillTransfer("127.0.0.1", port, LAYOUT, timeout_s=30.0)
    decode = GlooDecodeTransfer("127.0.0.1", LAYOUT)
    yield prefill, decode, port
    prefill.close()
    decode.close()


def _receive(decode: GlooDecodeTransfer, count: int) -> list[KVHandoff]:
    got: list[KVHandoff] = []
    deadline = time.monotonic() + DEADLINE_S
    while len(got) < count:
        assert time.monotonic() < deadline, f"received {len(got)} of {count}"
        decode.wait(0.05)
        got += decode.poll()
    return got


def _wait_for(done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not done():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def _kv(tokens: int, seed: int) -> torch.Tensor:
    return torch.randn(3, 2, tokens, 2, 8, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def test_claimed_rooms_get_their_kv_bit_for_bit(
    sides: tuple[GlooPrefillTransfer, GlooDecodeTransfer, int],
) -> None:
    prefill, decode, port = sides
    rooms = [0, 2**32 + 1, 2**63 - 1]
    kvs = {room: _kv(5 + i, i) for i, room in enumerate(rooms)}
    logprobs = {"logprobs": [-0.25], "top_ids": [], "top_logprobs": [], "id_logprobs": []}
    for room in rooms:
        prefill.send(KVHandoff(room, kvs[room], first_token=room % 1000, logprobs=logprobs))
    for room in rooms:
        decode.expect(room, "127.0.0.1", port)
    got = {h.room: h for h in _receive(decode, len(rooms))}
    assert set(got) == set(rooms)
    for room in rooms:
        kv = got[room].kv
        assert kv is not None and kv.dtype == torch.bfloat16
        assert torch.equal(kv, kvs[room])
        assert got[room].first_token == room % 1000 and got[room].logprobs == logprobs
    # The sender counts a handoff once its last send returns, which may be after the receiver has it.
    _wait_for(lambda: prefill.stats()["handoffs"] >= len(rooms))
    stats = prefill.stats()
    assert stats["handoffs"] == 3 and stats["peers"] == 1
    assert stats["bytes"] > sum(t.numel() * 2 for t in kvs.values())


def test_a_room_the_decode_side_gives_up_is_dropped(
    sides: tuple[GlooPrefillTransfer, GlooDecodeTransfer, int],
) -> None:
    prefill, decode, port = sides
    decode.forget(7, "127.0.0.1", port)
    prefill.send(KVHandoff(7, _kv(4, 0), first_token=1))
    _wait_for(lambda: prefill.stats()["dropped"] > 0)
    assert prefill.stats()["waiting_for_claim"] == 0
    # The next room on the same pair is unaffected, and an abort notice reaches the decode side.
    prefill.send(KVHandoff(8, None, message="prefill gave up"))
    decode.expect(8, "127.0.0.1", port)
    (got,) = _receive(decode, 1)
    assert (got.room, got.kv, got.message) == (8, None, "prefill gave up")


def test_a_closing_prefill_side_fails_the_rooms_still_expected() -> None:
    port = free_port()
    prefill = GlooPrefillTransfer("127.0.0.1", port, LAYOUT, timeout_s=30.0)
    decode = GlooDecodeTransfer("127.0.0.1", LAYOUT)
    try:
        decode.expect(3, "127.0.0.1", port)
        deadline = time.monotonic() + DEADLINE_S
        while prefill.stats()["peers"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        prefill.close()
        (got,) = _receive(decode, 1)
        assert got.room == 3 and got.kv is None and "closed" in got.message
    finally:
        decode.close()


def test_a_decode_side_of_another_layout_is_refused() -> None:
    port = free_port()
    prefill = GlooPrefillTransfer("127.0.0.1", port, LAYOUT, timeout_s=30.0)
    decode = GlooDecodeTransfer("127.0.0.1", layout_signature((3, 2, 2, 8), torch.float32))
    try:
        decode.expect(1, "127.0.0.1", port)
        (got,) = _receive(decode, 1)
        assert got.kv is None and "K/V layout" in got.message
    finally:
        prefill.close()
        decode.close()


def test_a_late_give_up_never_drops_or_feeds_the_rooms_next_request(
    sides: tuple[GlooPrefillTransfer, GlooDecodeTransfer, int],
) -> None:
    prefill, decode, port = sides
    decode.expect(5, "127.0.0.1", port)
    prefill.send(KVHandoff(5, _kv(4, 0), first_token=1))
    _wait_for(lambda: prefill.stats()["handoffs"] > 0)
    # Given up after its K/V left the prefill side and before the scheduler polled it.
    decode.forget(5, "127.0.0.1", port)
    # The decode side's commands run in order: once room 6 arrives, the give-up has been written.
    decode.expect(6, "127.0.0.1", port)
    prefill.send(KVHandoff(6, _kv(4, 6), first_token=6))
    (got,) = _receive(decode, 1)
    assert got.room == 6
    # The room's next request reaches the prefill side before the decode side claims it again.
    prefill.send(KVHandoff(5, _kv(7, 1), first_token=2))
    time.sleep(0.3)  # many rounds of the prefill side's polling
    assert prefill.stats()["dropped"] == 0 and prefill.stats()["waiting_for_claim"] == 1
    decode.expect(5, "127.0.0.1", port)
    (got,) = _receive(decode, 1)
    assert got.room == 5 and got.first_token == 2 and got.kv is not None
    assert torch.equal(got.kv, _kv(7, 1))
