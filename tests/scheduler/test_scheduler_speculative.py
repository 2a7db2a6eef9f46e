"""NGRAM speculative decoding in the scheduler, on the fake executor: exact greedy outputs, the KV
accounting after every step (verify steps, rejected drafts, finishes partway along a draft,
aborts, retraction), and the tokens that come out of the tree sampler."""

from __future__ import annotations

from typing import Any

import pytest

from radixserve.forward.batch import ForwardMode
from radixserve.protocol.messages import GenerateRequest
from radixserve.protocol.sampling_params import SamplingParams
from radixserve.scheduler.scheduler import Scheduler
from tests.scheduler.fake_executor import (
    FakeExecutor,
    Results,
    abort_after_first_verify,
    check_finishes_partway,
    check_kv_accounting,
    expected_output,
    greedy,
    make_scheduler,
    run_until_idle,
    submit,
)

VOCAB = 1024
MAX_NEW = 30
PROMPTS = {f"p{i}": list(range(10 * i + 3, 10 * i + 3 + n)) for i, n in enumerate([7, 12, 5, 20])}


def _scheduler(executor: FakeExecutor | None = None, **args: Any) -> Scheduler:
    args.setdefault("speculative_algorithm", "NGRAM")
    args.setdefault("disable_overlap_schedule", True)
    # Drafting as the index offers: the adaptive gate weighs the fake's (meaningless) timings.
    args.setdefault("disable_speculative_adaptive", True)
    return make_scheduler(executor or FakeExecutor(vocab_size=VOCAB), **args)


def _serve_twice(scheduler: Scheduler, max_new: int = MAX_NEW, **params: Any) -> Results:
    """Every prompt once (which fills the n-gram index), then every prompt again (which drafts
    from it), checking the KV accounting after every step."""
    results = Results()
    for turn in ("first", "again"):
        for rid, prompt in PROMPTS.items():
            submit(scheduler, results, f"{rid}-{turn}", prompt, max_new, **params)
        run_until_idle(scheduler, results)
    return results


def _verify_steps(executor: FakeExecutor) -> int:
    return sum(b.mode is ForwardMode.VERIFY for b in executor.batches)


@pytest.mark.parametrize(
    "args",
    [
        {},
        {"page_size": 4},
        {"disable_radix_cache": True},
        {"speculative_ngram_match_type": "PROB"},
        {"speculative_num_draft_tokens": 3},
        {"chunked_prefill_size": 4, "page_size": 2},
        {"disable_speculative_adaptive": False},
    ],
    ids=["default", "page4", "no-radix", "prob", "k3", "chunked", "adaptive"],
)
def test_greedy_outputs_are_exact_and_drafts_are_accepted(args: dict[str, Any]) -> None:
    executor = FakeExecutor(vocab_size=VOCAB)
    scheduler = _scheduler(executor, **args)
    results = _serve_twice(scheduler)
    for rid, prompt in PROMPTS.items():
        for turn in ("first", "again"):
            assert results.tokens[f"{rid}-{turn}"] == expected_output(prompt, MAX_NEW, VOCAB)
            assert results.finish[f"{rid}-{turn}"].type == "length"
    stats = scheduler.stats
    scheduler.check_kv_invariant()
    if not scheduler.speculator or scheduler.speculator.adaptive:
        return  # what the adaptive gate drafts depends on timings: only the outputs are checked
    assert _verify_steps(executor) > 0
    # The repeats draft their own earlier outputs: accepted, several tokens per verify step.
    assert stats.spec_accepted_tokens >= len(PROMPTS) * (MAX_NEW // 2)
    assert stats.spec_accept_length > 1.5


def test_a_tree_of_several_branches_verifies_in_one_step() -> None:
    executor = FakeExecutor(vocab_size=VOCAB)
    scheduler = _scheduler(executor, speculative_num_draft_tokens=8)
    prompt = list(range(600, 620))
    truth = expected_output(prompt, 8, VOCAB)
    # Two earlier texts continue the prompt's end and its first output token two ways: a wrong one
    # (ranked first: an equal count and a smaller token) and the true one. The first verify step
    # drafts both branches, and the accepted path runs through the second child.
    tail = [*prompt[-6:], truth[0]]
    wrong = (truth[1] + VOCAB - 1) % VOCAB
    texts = {"wrong": [*tail, wrong, 1, 2, 3], "true": [*tail, *truth[1:]]}
    results = Results()
    for rid, text in texts.items():
        submit(scheduler, results, rid, text, 1)
    run_until_idle(scheduler, results)
    trees = []
    original = scheduler.decode.next_batch

    def watched(speculator: Any = None) -> Any:
        batch = original(speculator)
        if batch.verify is not None:
            trees.extend(t for t in batch.verify.trees if not t.is_chain)
        return batch

    scheduler.decode.next_batch = watched  # type: ignore[method-assign]
    submit(scheduler, results, "z", prompt, 8)
    run_until_idle(scheduler, results)
    assert results.tokens["z"] == truth
    assert trees, "no verify step drafted a tree with branches"
    assert trees[0].children()[0] == {wrong: 1, truth[1]: 2}
    assert scheduler.stats.spec_accepted_tokens >= 3
    scheduler.check_kv_invariant()


def test_a_finish_partway_along_an_accepted_draft_keeps_only_what_was_emitted() -> None:
    executor = FakeExecutor(vocab_size=VOCAB)
    scheduler = _scheduler(executor)
    results = Results()
    submit(scheduler, results, "warm", PROMPTS["p1"], MAX_NEW)
    run_until_idle(scheduler, results)
    # The repeat's drafts run past the stop token; it must end exactly there, and its KV too.
    check_finishes_partway(scheduler, results, PROMPTS["p1"], MAX_NEW)
    assert scheduler.stats.spec_accepted_tokens > 0


def test_an_abort_between_verify_steps_frees_everything() -> None:
    executor = FakeExecutor(vocab_size=VOCAB)
    scheduler = _scheduler(executor, page_size=4)
    results = Results()
    submit(scheduler, results, "warm", PROMPTS["p3"], MAX_NEW)
    run_until_idle(scheduler, results)
    results = abort_after_first_verify(scheduler, executor, PROMPTS["p3"], PROMPTS["p0"], MAX_NEW)
    assert results.tokens["other"] == expected_output(PROMPTS["p0"], MAX_NEW, VOCAB)
    scheduler.check_kv_invariant()


def test_retraction_with_speculation() -> None:
    executor = FakeExecutor(vocab_size=VOCAB, max_total_tokens=96)
    scheduler = _scheduler(executor, schedule_conservativeness=0.05)
    results = _serve_twice(scheduler, max_new=24)
    for rid, prompt in PROMPTS.items():
        assert results.tokens[f"{rid}-again"] == expected_output(prompt, 24, VOCAB)
    assert scheduler.stats.retracted_reqs > 0
    assert scheduler.stats.spec_accepted_tokens > 0
    scheduler.check_kv_invariant()


def test_logprobs_one_per_token_and_hidden_state_requests_decode_normally() -> None:
    executor = FakeExecutor(vocab_size=VOCAB)
    scheduler = _scheduler(executor)
    prompt = PROMPTS["p2"]
    results = Results()
    submit(scheduler, results, "warm", prompt, MAX_NEW)
    run_until_idle(scheduler, results)
    outputs = []
    for rid, extra in (("logprobs", {"return_logprob": True}), ("hidden", {"return_hidden_states": True})):
        message = GenerateRequest(rid, prompt, SamplingParams.from_dict(greedy(MAX_NEW)), **extra)
        outputs += scheduler.handle(message)
    while not scheduler.is_idle:
        outputs += scheduler.step()
        check_kv_accounting(scheduler)
    finals = {o.rid: o for o in outputs if getattr(o, "finished_reason", None) is not None}
    expected = expected_output(prompt, MAX_NEW, VOCAB)
    tokens = {
        rid: [t for o in outputs if getattr(o, "rid", None) == rid for t in o.new_token_ids] for rid in finals
    }
    assert tokens["logprobs"] == expected and tokens["hidden"] == expected
    logprobs = [lp for o in outputs if getattr(o, "rid", None) == "logprobs" for lp in o.logprobs.logprobs]
    assert len(logprobs) == MAX_NEW
    assert all(v == pytest.approx(logprobs[0], abs=1e-5) for v in logprobs), logprobs
    hidden = [h for o in outputs if getattr(o, "rid", None) == "hidden" for h in o.hidden_states]
    assert len(hidden) == MAX_NEW
    scheduler.check_kv_invariant()
