"""Prefill/decode disaggregation in the scheduler: a prefill scheduler and a decode scheduler over
fake executors (whose "K/V" per slot is its token and position, checked on every read), joined by
the real transport (a TCPStore and a gloo pair on loopback). Outputs equal one server's, K/V moves
only to the server that claimed the room, and every way of giving a request up leaks nothing on
either side."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from radixserve.executor.base import KVLayout
from radixserve.protocol.messages import BootstrapInfo, ControlRequest, ControlResult, GenerateRequest
from radixserve.protocol.sampling_params import SamplingParams
from radixserve.scheduler.disaggregation.decode import PREFILL_FAILED_STATUS, PREFILL_TIMEOUT_STATUS
from radixserve.scheduler.scheduler import Scheduler
from tests.ports import free_port
from tests.scheduler.fake_executor import (
    FakeExecutor,
    Results,
    check_kv_accounting,
    expected_output,
    greedy,
    make_scheduler,
)

VOCAB = 1024
# A room above 2^32 and one near 2^63: the header carries rooms as two 32-bit halves.
BIG_ROOM = 2**40 + 7
HUGE_ROOM = 2**63 - 3
DEADLINE_S = 60.0


class Pair:
    """A prefill scheduler and a decode scheduler, stepped in turn from this thread."""

    def __init__(self, decode_pool: int = 4096, timeout_s: float = 60.0, **args: Any):
        self.port = free_port()
        common = {"disable_overlap_schedule": True, "disaggregation_timeout": timeout_s, **args}
        self.prefill = make_scheduler(
            FakeExecutor(vocab_size=VOCAB),
            disaggregation_mode="prefill",
            disaggregation_bootstrap_port=self.port,
            **common,
        )
        self.decode = make_scheduler(
            FakeExecutor(vocab_size=VOCAB, max_total_tokens=decode_pool),
            disaggregation_mode="decode",
            **common,
        )
        self.prefill_results, self.decode_results = Results(), Results()

    def bootstrap(self, room: int) -> BootstrapInfo:
        return BootstrapInfo("127.0.0.1", self.port, room)

    def submit(self, rid: str, prompt: list[int], max_new: int, room: int, to: str = "both") -> None:
        """As sglang-router does: the same request, with the same room, to both servers."""
        if to in ("both", "prefill"):
            msg = GenerateRequest(
                rid, prompt, SamplingParams.from_dict(greedy(max_new)), bootstrap=self.bootstrap(room)
            )
            self.prefill_results.take(self.prefill.handle(msg))
        if to in ("both", "decode"):
            msg = GenerateRequest(
                rid, prompt, SamplingParams.from_dict(greedy(max_new)), bootstrap=self.bootstrap(room)
            )
            self.decode_results.take(self.decode.handle(msg))

    def step(self) -> None:
        for scheduler, results in ((self.prefill, self.prefill_results), (self.decode, self.decode_results)):
            check_kv_accounting(scheduler)
            if not scheduler.is_idle:
                results.take(scheduler.step())
            check_kv_accounting(scheduler)

    def run(self, until_finished: set[str]) -> None:
        """Steps both until the decode side has finished these requests and both are idle."""
        deadline = time.monotonic() + DEADLINE_S
        while not (until_finished <= set(self.decode_results.finish) and self.idle):
            assert time.monotonic() < deadline, (
                f"unfinished: {until_finished - set(self.decode_results.finish)}"
            )
            self.step()
            time.sleep(0.001)
        for scheduler, results in ((self.prefill, self.prefill_results), (self.decode, self.decode_results)):
            results.take(scheduler.step())  # the idle step runs the scheduler's own KV self-check
            scheduler.check_kv_invariant()

    @property
    def idle(self) -> bool:
        return self.prefill.is_idle and self.decode.is_idle

    def close(self) -> None:
        for scheduler in (self.prefill, self.decode):
            for handoffs in (scheduler.prefill_handoffs, scheduler.decode_handoffs):
                if handoffs is not None:
                    handoffs.close()


@pytest.fixture
def pair() -> Iterator[Pair]:
    made = Pair()
    yield made
    made.close()


def _prompts(count: int, length: int = 20) -> dict[str, list[int]]:
    return {f"r{i}": [(7 * i + 3 * j + 1) % VOCAB for j in range(length + i)] for i in range(count)}


def _handoff_stats(scheduler: Scheduler) -> dict[str, Any]:
    """This half's handoffs as get_stats reports them (asked of the commands directly: through
    Scheduler.handle, the outputs it publishes first would be lost to the pair)."""
    (reply,) = scheduler.controls.handle(ControlRequest("stats", "get_stats"))
    assert isinstance(reply, ControlResult) and reply.ok, reply
    stats: dict[str, Any] = reply.payload["disaggregation"]
    return stats


def _wait_for(condition: Any, pair: Pair) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline
        pair.step()
        time.sleep(0.001)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_outputs_equal_one_server_and_the_prefill_side_keeps_the_prefix(overlap: bool) -> None:
    pair = Pair(**({"enable_overlap_schedule": True, "disable_overlap_schedule": False} if overlap else {}))
    try:
        assert (pair.prefill.publisher is not None) == overlap
        _outputs_equal_one_server(pair)
    finally:
        pair.close()


def _outputs_equal_one_server(pair: Pair) -> None:
    prompts = _prompts(6)
    rooms = [BIG_ROOM, HUGE_ROOM, 1, 2, 3, 4]
    for (rid, prompt), room in zip(prompts.items(), rooms, strict=True):
        pair.submit(rid, prompt, 9, room)
    pair.run(set(prompts))
    for rid, prompt in prompts.items():
        expected = expected_output(prompt, 9, VOCAB)
        assert pair.decode_results.tokens[rid] == expected
        assert pair.decode_results.finish[rid].type == "length"
        # The prefill server answers with the first token only.
        assert pair.prefill_results.tokens[rid] == expected[:1]
    # A handoff is counted once its last send returns, which can be after the receiver has it.
    _wait_for(lambda: _handoff_stats(pair.prefill)["waiting_for_claim"] == 0, pair)
    stats = _handoff_stats(pair.prefill)
    assert stats["mode"] == "prefill" and stats["handoffs"] == len(prompts) and stats["failed"] == 0
    assert _handoff_stats(pair.decode)["handoffs"] == len(prompts)
    # Radix caching stays on the prefill side: the same prompt again is a cache hit there.
    rid, prompt = "again", prompts["r0"]
    pair.submit(rid, prompt, 9, 99)
    pair.run({rid})
    assert pair.decode_results.tokens[rid] == expected_output(prompt, 9, VOCAB)
    assert pair.prefill.stats.cached_tokens > 0


def test_a_decode_server_short_of_kv_claims_rooms_only_as_slots_free_up() -> None:
    pair = Pair(decode_pool=160)
    try:
        prompts = _prompts(8, length=30)
        for room, (rid, prompt) in enumerate(prompts.items()):
            pair.submit(rid, prompt, 12, room)
        pair.step()
        assert len(pair.decode.decode_handoffs.awaiting) > 0  # type: ignore[union-attr]
        pair.run(set(prompts))
        for rid, prompt in prompts.items():
            assert pair.decode_results.tokens[rid] == expected_output(prompt, 12, VOCAB)
    finally:
        pair.close()


def test_an_abort_on_the_decode_side_before_the_kv_comes_leaks_nothing_on_either(pair: Pair) -> None:
    prompt = _prompts(1)["r0"]
    pair.submit("gone", prompt, 9, 5, to="decode")
    _wait_for(lambda: pair.decode.decode_handoffs.awaiting[5].claimed, pair)  # type: ignore[union-attr]
    pair.decode_results.take(pair.decode.abort("gone"))
    assert pair.decode_results.finish["gone"].type == "abort"
    # The prefill side gets the request late: it computes it, then drops it unclaimed.
    pair.submit("gone", prompt, 9, 5, to="prefill")
    _wait_for(lambda: _handoff_stats(pair.prefill)["waiting_for_claim"] == 0 and pair.idle, pair)
    # Nothing arrived for a request that is gone; a new request in the same room works.
    pair.submit("next", prompt, 9, 5)
    pair.run({"next"})
    assert pair.decode_results.tokens["next"] == expected_output(prompt, 9, VOCAB)


def test_an_abort_on_the_prefill_side_ends_the_request_on_the_decode_side(pair: Pair) -> None:
    prompt = _prompts(1)["r0"]
    pair.submit("r", prompt, 9, 8, to="decode")
    pair.submit("r", prompt, 9, 8, to="prefill")
    pair.prefill_results.take(pair.prefill.abort("r"))  # before its prefill ran
    pair.run({"r"})
    finish = pair.decode_results.finish["r"]
    assert finish.type == "abort" and finish.status_code == PREFILL_FAILED_STATUS
    assert "prefill server ended the request" in (finish.message or "")


def test_a_prefill_server_that_never_sends_times_out_on_the_decode_side() -> None:
    pair = Pair(timeout_s=0.3)
    try:
        pair.submit("lost", _prompts(1)["r0"], 9, 11, to="decode")
        pair.run({"lost"})
        finish = pair.decode_results.finish["lost"]
        assert finish.type == "abort" and finish.status_code == PREFILL_TIMEOUT_STATUS
    finally:
        pair.close()


def test_requests_without_bootstrap_fields_are_refused_by_either_half(pair: Pair) -> None:
    for scheduler, mode in ((pair.prefill, "prefill"), (pair.decode, "decode")):
        results = Results()
        results.take(
            scheduler.handle(GenerateRequest("plain", [1, 2, 3], SamplingParams.from_dict(greedy(4))))
        )
        finish = results.finish["plain"]
        assert finish.type == "abort" and f"this is a {mode} server" in (finish.message or "")
        assert scheduler.is_idle


class _TwoLayerExecutor(FakeExecutor):
    def kv_layout(self) -> KVLayout:
        return KVLayout(2, 1, 1, torch.int64)


def test_a_decode_server_of_another_model_is_refused_at_the_bootstrap() -> None:
    port = free_port()
    prefill = make_scheduler(
        FakeExecutor(vocab_size=VOCAB),
        disaggregation_mode="prefill",
        disaggregation_bootstrap_port=port,
        disable_overlap_schedule=True,
    )
    other = _TwoLayerExecutor(vocab_size=VOCAB)
    decode: Scheduler = make_scheduler(other, disaggregation_mode="decode", disable_overlap_schedule=True)
    try:
        results = Results()
        bootstrap = BootstrapInfo("127.0.0.1", port, 1)
        results.take(
            decode.handle(
                GenerateRequest("r", [1, 2, 3], SamplingParams.from_dict(greedy(4)), bootstrap=bootstrap)
            )
        )
        deadline = time.monotonic() + DEADLINE_S
        while "r" not in results.finish:
            assert time.monotonic() < deadline
            results.take(decode.step())
        assert "K/V layout" in (results.finish["r"].message or "")
        results.take(decode.step())
        decode.check_kv_invariant()
    finally:
        for handoffs in (prefill.prefill_handoffs, decode.decode_handoffs):
            assert handoffs is not None
            handoffs.close()
