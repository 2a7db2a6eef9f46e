"""The data-parallel router: round robin, least outstanding tokens, cache-aware prefixes, sessions;
and merging the replicas' answers to a control command."""

from __future__ import annotations

from radixserve.protocol.messages import GenerateRequest
from radixserve.protocol.sampling_params import SamplingParams
from radixserve.runtime.dp_router import BALANCE_ABS, PREFIX_BLOCK, Router, merge_replica_payloads


def request(
    rid: str, prompt_len: int = 10, max_new: int = 10, first: int = 1, session: str | None = None
) -> GenerateRequest:
    ids = [first + i for i in range(prompt_len)]
    return GenerateRequest(
        rid, ids, SamplingParams.from_dict({"max_new_tokens": max_new}), session_id=session
    )


def test_round_robin_takes_turns() -> None:
    router = Router(3, "round_robin")
    assert [router.pick(request(f"r{i}")) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert router.served == [3, 2, 2]


def test_shortest_queue_counts_outstanding_tokens_until_done() -> None:
    router = Router(2, "shortest_queue")
    assert router.pick(request("big", prompt_len=500, max_new=100)) == 0
    # Replica 0 holds 600 tokens of work: the next small ones all go to replica 1 until it has more.
    assert [router.pick(request(f"s{i}", prompt_len=90, max_new=10)) for i in range(6)] == [1] * 6
    assert router.outstanding == [600, 600]
    assert router.pick(request("tie")) == 0  # ties go to the lowest rank
    router.done("big")
    router.done("tie")
    assert router.outstanding == [0, 600]
    assert router.pick(request("after")) == 0


def test_cache_aware_sends_shared_prefixes_to_one_replica() -> None:
    router = Router(2, "cache_aware")
    long = PREFIX_BLOCK * 3
    first = router.pick(request("a", prompt_len=long, first=1000))
    other = router.pick(request("b", prompt_len=long, first=5000))
    assert first != other  # no shared prefix: the least loaded replica
    # Same first 2 blocks as "a", then different tokens: "a"'s replica, however loaded.
    shared = GenerateRequest(
        "c",
        list(range(1000, 1000 + 2 * PREFIX_BLOCK)) + [7] * 30,
        SamplingParams.from_dict({"max_new_tokens": 5}),
    )
    for i in range(3):
        assert (
            router.pick(
                GenerateRequest(f"c{i}", shared.input_ids, SamplingParams.from_dict({"max_new_tokens": 5}))
            )
            == first
        )


def test_a_session_stays_on_its_replica() -> None:
    router = Router(2, "round_robin")
    home = router.pick(request("t1", session="chat"))
    assert [router.pick(request(f"t{i}", session="chat")) for i in range(2, 5)] == [home] * 3
    router.forget_session("chat")
    router.pick(request("x"))  # round robin moves on
    assert router.pick(request("t9", session="chat")) in (0, 1)


def test_replica_answers_merge() -> None:
    merged = merge_replica_payloads(
        [
            {
                "idle": True,
                "kv_invariant": "ok",
                "generated_tokens": 5,
                "token_usage": 0.2,
                "max_total_tokens": 100,
                "memory_released": [],
            },
            {
                "idle": False,
                "kv_invariant": "violated: x",
                "generated_tokens": 7,
                "token_usage": 0.4,
                "max_total_tokens": 100,
                "memory_released": [],
            },
        ]
    )
    assert merged["idle"] is False
    assert merged["kv_invariant"] == "dp rank 1: violated: x"
    assert merged["generated_tokens"] == 12 and merged["max_total_tokens"] == 100
    assert abs(merged["token_usage"] - 0.3) < 1e-9
    assert len(merged["dp_replicas"]) == 2


def test_cache_aware_spills_over_when_one_replica_is_far_ahead() -> None:
    router = Router(2, "cache_aware")
    shared = list(range(100, 100 + 512))
    picks = [
        router.pick(GenerateRequest(f"w{i}", [*shared, i], SamplingParams.from_dict({"max_new_tokens": 32})))
        for i in range(32)
    ]
    # All share a prefix, but past BALANCE_ABS tokens of lead the other replica takes some, and
    # from then on both replicas hold the prefix.
    assert picks[:7] == [0] * 7 and 1 in picks
    assert abs(router.outstanding[0] - router.outstanding[1]) <= BALANCE_ABS + 545
