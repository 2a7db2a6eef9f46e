"""STANDALONE speculative decoding (a draft model) in the scheduler, on fake executors: exact greedy
outputs, every draft of a perfect draft model accepted, the draft's K/V read only where it is
valid (FakeDraft checks every read), and the KV accounting after every step through rejected
drafts, a prefix from the radix cache, chunked catch-up, finishes partway, aborts and retraction."""

from __future__ import annotations

from typing import Any

import pytest

from radixserve.config.server_args import InvalidArgumentError, ServerArgs
from radixserve.forward.batch import ForwardMode
from radixserve.protocol.messages import ControlRequest
from radixserve.scheduler.scheduler import Scheduler
from tests.scheduler.fake_executor import (
    FakeDraft,
    FakeExecutor,
    Results,
    abort_after_first_verify,
    check_finishes_partway,
    expected_output,
    run_until_idle,
    submit,
)
from tests.scheduler.test_scheduler_speculative import MAX_NEW, PROMPTS, VOCAB


def _scheduler(
    executor: FakeExecutor | None = None, miss_period: int = 0, **args: Any
) -> tuple[Scheduler, FakeExecutor, FakeDraft]:
    target = executor or FakeExecutor(vocab_size=VOCAB)
    draft = FakeDraft(vocab_size=VOCAB, max_total_tokens=target.max_total_tokens, target=target)
    draft.miss_period = miss_period
    args.setdefault("speculative_algorithm", "STANDALONE")
    args.setdefault("speculative_draft_model_path", "fake-draft")
    args.setdefault("disable_overlap_schedule", True)
    # Drafting without the adaptive gate, which weighs the fakes' (meaningless) timings.
    args.setdefault("disable_speculative_adaptive", True)
    args.setdefault("log_level", "warning")
    return Scheduler(ServerArgs(**args), target, draft=draft), target, draft


def _serve(scheduler: Scheduler, turns: tuple[str, ...] = ("first",), max_new: int = MAX_NEW) -> Results:
    results = Results()
    for turn in turns:
        for rid, prompt in PROMPTS.items():
            submit(scheduler, results, f"{rid}-{turn}", prompt, max_new)
        run_until_idle(scheduler, results)
    return results


def _check_outputs(results: Results, turns: tuple[str, ...], max_new: int = MAX_NEW) -> None:
    for rid, prompt in PROMPTS.items():
        for turn in turns:
            assert results.tokens[f"{rid}-{turn}"] == expected_output(prompt, max_new, VOCAB), (rid, turn)


@pytest.mark.parametrize(
    "args",
    [
        {},
        {"page_size": 4},
        {"disable_radix_cache": True},
        {"speculative_num_steps": 1},
        {"speculative_num_steps": 7, "page_size": 2},
        # Catch-up of at most 4 tokens a step: the prompts are caught up over several steps.
        {"chunked_prefill_size": 4, "page_size": 2},
    ],
    ids=["default", "page4", "no-radix", "steps1", "steps7-page2", "chunked"],
)
def test_a_perfect_draft_has_every_draft_accepted(args: dict[str, Any]) -> None:
    scheduler, target, _ = _scheduler(**args)
    turns = ("first", "again")  # the second turn starts from prefixes in the radix cache
    results = _serve(scheduler, turns)
    _check_outputs(results, turns)
    stats = scheduler.stats
    assert any(b.mode is ForwardMode.VERIFY for b in target.batches)
    assert stats.spec_draft_tokens > len(PROMPTS) * MAX_NEW // 2
    assert stats.spec_accepted_tokens == stats.spec_draft_tokens
    steps = scheduler.args.speculative_num_steps
    assert steps is not None and stats.spec_accept_length > min(steps + 1, 2) - 0.01
    scheduler.check_kv_invariant()


@pytest.mark.parametrize(
    "args", [{}, {"page_size": 4}, {"chunked_prefill_size": 4}], ids=["default", "page4", "chunked"]
)
def test_a_draft_that_misses_changes_no_output(args: dict[str, Any]) -> None:
    scheduler, _, _ = _scheduler(miss_period=3, speculative_num_steps=4, **args)
    turns = ("first", "again")
    results = _serve(scheduler, turns)
    _check_outputs(results, turns)
    stats = scheduler.stats
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    scheduler.check_kv_invariant()


def test_a_cached_prefix_keeps_the_draft_kv_it_has() -> None:
    scheduler, _, draft = _scheduler()
    prompt = PROMPTS["p3"]
    results = Results()
    submit(scheduler, results, "first", prompt, MAX_NEW)
    run_until_idle(scheduler, results)
    drafted = len(draft.batches)
    submit(scheduler, results, "again", prompt + results.tokens["first"][:10], 8)
    run_until_idle(scheduler, results)
    # The repeat's prefix was drafted over the first time: its first draft extend starts there,
    # not at position 0 (and FakeDraft checked that what it read there is right).
    first_extend = next(b for b in draft.batches[drafted:] if b.mode is ForwardMode.EXTEND)
    assert first_extend.prefix_lens[0] >= len(prompt)
    assert results.tokens["again"] == expected_output(prompt + results.tokens["first"][:10], 8, VOCAB)
    # After /flush_cache the draft's K/V counts for nothing: the next request catches up from 0.
    assert scheduler.flush_cache()
    drafted = len(draft.batches)
    submit(scheduler, results, "flushed", prompt, 8)
    run_until_idle(scheduler, results)
    first_extend = next(b for b in draft.batches[drafted:] if b.mode is ForwardMode.EXTEND)
    assert first_extend.prefix_lens[0] == 0
    scheduler.check_kv_invariant()


def test_finishes_partway_along_the_drafts_keep_only_what_was_emitted() -> None:
    scheduler, _, _ = _scheduler(speculative_num_steps=6)
    check_finishes_partway(scheduler, Results(), PROMPTS["p1"], MAX_NEW)
    assert scheduler.stats.spec_accepted_tokens > 0


def test_an_abort_between_verify_steps_frees_both_pools() -> None:
    scheduler, target, _ = _scheduler(page_size=4)
    results = abort_after_first_verify(scheduler, target, PROMPTS["p3"], PROMPTS["p0"], MAX_NEW)
    assert results.tokens["other"] == expected_output(PROMPTS["p0"], MAX_NEW, VOCAB)
    scheduler.check_kv_invariant()


def test_retraction_with_a_draft_model() -> None:
    scheduler, _, _ = _scheduler(
        FakeExecutor(vocab_size=VOCAB, max_total_tokens=96), miss_period=4, schedule_conservativeness=0.05
    )
    results = _serve(scheduler, ("first",), max_new=24)
    _check_outputs(results, ("first",), max_new=24)
    assert scheduler.stats.retracted_reqs > 0
    assert scheduler.stats.spec_accepted_tokens > 0
    scheduler.check_kv_invariant()


def test_the_adaptive_gate_keeps_outputs_exact() -> None:
    scheduler, _, _ = _scheduler(miss_period=2, disable_speculative_adaptive=False)
    results = _serve(scheduler)
    _check_outputs(results, ("first",))
    scheduler.check_kv_invariant()


def test_memory_release_takes_the_draft_along() -> None:
    scheduler, _, draft = _scheduler()
    results = _serve(scheduler)
    for command in ("release_memory_occupation", "resume_memory_occupation"):
        results.take(scheduler.handle(ControlRequest(command, command, {"tags": ["kv_cache"]})))
        assert draft.released == ({"kv_cache"} if command.startswith("release") else set())
    assert [c.error for c in results.controls] == [None, None]
    # The draft's K/V is gone with the release: the next request catches the draft up from 0.
    drafted = len(draft.batches)
    submit(scheduler, results, "after", PROMPTS["p1"], MAX_NEW)
    run_until_idle(scheduler, results)
    assert results.tokens["after"] == expected_output(PROMPTS["p1"], MAX_NEW, VOCAB)
    assert next(b for b in draft.batches[drafted:] if b.mode is ForwardMode.EXTEND).prefix_lens[0] == 0


def test_the_draft_pool_must_match_the_target() -> None:
    target = FakeExecutor(vocab_size=VOCAB)
    small = FakeDraft(vocab_size=VOCAB, max_total_tokens=target.max_total_tokens // 2)
    args = ServerArgs(
        speculative_algorithm="STANDALONE", speculative_draft_model_path="d", log_level="warning"
    )
    with pytest.raises(ValueError, match="as many slots"):
        Scheduler(args, target, draft=small)
    with pytest.raises(ValueError, match="needs the draft model"):
        Scheduler(args, target)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"speculative_algorithm": "STANDALONE"}, "needs --speculative-draft-model-path"),
        ({"speculative_algorithm": "EAGLE"}, "trained draft head"),
        (
            {"speculative_algorithm": "NGRAM", "speculative_draft_model_path": "d"},
            "is for --speculative-algorithm",
        ),
        (
            {
                "speculative_algorithm": "STANDALONE",
                "speculative_draft_model_path": "d",
                "speculative_num_steps": 0,
            },
            "must be >= 1",
        ),
    ],
)
def test_draft_model_flags_are_checked(args: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        ServerArgs(**args)


def test_num_steps_sets_the_chain_length() -> None:
    args = ServerArgs(speculative_algorithm="standalone", speculative_draft_model_path="d")
    assert (args.speculative_algorithm, args.speculative_num_steps) == ("STANDALONE", 4)
    assert args.speculative_num_draft_tokens == 5
    args = ServerArgs(
        speculative_algorithm="STANDALONE", speculative_draft_model_path="d", speculative_num_steps=2
    )
    assert args.speculative_num_draft_tokens == 3
