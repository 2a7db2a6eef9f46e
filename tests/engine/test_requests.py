"""Request-level behaviour of the engine: sampling, stop conditions, aborts, bad input, streaming."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from radixserve.config.server_args import ServerArgs
from radixserve.protocol.messages import (
    NON_STREAM_OUTPUT_INTERVAL,
    ControlRequest,
    ControlResult,
    GenerateRequest,
)
from radixserve.protocol.sampling_params import InvalidRequestError, SamplingParams
from radixserve.scheduler.process import build_scheduler
from tests.engine.oracle import GREEDY, GreedyOracle, random_prompts, run_scheduler


@pytest.fixture
def engine(tiny_model_dir: Callable[[str], Path], make_engine: Callable[..., Any]) -> Any:
    return make_engine(tiny_model_dir("llama"), max_total_tokens=2048)


def test_seeded_sampling_is_reproducible_whatever_the_batch(engine: Any) -> None:
    prompts = random_prompts(4, seed=20)
    params = {
        "temperature": 1.0,
        "top_p": 0.9,
        "top_k": 50,
        "max_new_tokens": 16,
        "ignore_eos": True,
        "seed": 7,
    }
    alone = engine.generate(input_ids=prompts[0], sampling_params=params)
    batched = engine.generate(input_ids=prompts, sampling_params=params)
    assert alone["output_ids"] == batched[0]["output_ids"]
    other_seed = engine.generate(input_ids=prompts[0], sampling_params={**params, "seed": 8})
    assert other_seed["output_ids"] != alone["output_ids"]


def test_top_k_one_is_greedy(engine: Any, oracle: Callable[[str], GreedyOracle]) -> None:
    prompt = random_prompts(1, [12], seed=21)[0]
    res = engine.generate(
        input_ids=prompt,
        sampling_params={"temperature": 0.8, "top_k": 1, "max_new_tokens": 10, "ignore_eos": True},
    )
    assert res["output_ids"] == oracle("llama").continue_(prompt, 10)


def test_stop_token_ids_end_the_request(engine: Any, oracle: Callable[[str], GreedyOracle]) -> None:
    prompt = random_prompts(1, [15], seed=22)[0]
    reference = oracle("llama").continue_(prompt, 12)
    stop = reference[4]
    res = engine.generate(
        input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 12, "stop_token_ids": [stop]}
    )
    assert res["output_ids"] == reference[: reference.index(stop) + 1]
    assert res["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_eos_ends_the_request_unless_ignored(
    tiny_model_dir: Callable[[str], Path], oracle: Callable[[str], GreedyOracle]
) -> None:
    prompt = random_prompts(1, [15], seed=23)[0]
    reference = oracle("llama").continue_(prompt, 12)
    # An in-process scheduler whose EOS is a token the reference emits, to exercise the EOS path for real.
    scheduler = build_scheduler(
        ServerArgs(model_path=str(tiny_model_dir("llama")), dtype="float32", max_total_tokens=512)
    )
    scheduler.requests.eos_token_ids = frozenset({reference[3]})
    stopped = run_scheduler(
        scheduler,
        GenerateRequest("stop", prompt, SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 12})),
    )
    assert stopped.output_ids == reference[:4]
    assert stopped.finished_reason is not None and stopped.finished_reason.type == "stop"
    ignored = run_scheduler(
        scheduler,
        GenerateRequest("ignore", prompt, SamplingParams.from_dict({**GREEDY, "max_new_tokens": 12})),
    )
    assert ignored.output_ids == reference
    scheduler.check_kv_invariant()


def test_max_new_tokens_zero_returns_nothing(engine: Any) -> None:
    res = engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 0})
    assert res["output_ids"] == [] and res["meta_info"]["finish_reason"]["type"] == "length"


def test_bad_requests_get_clear_errors_and_the_engine_keeps_serving(engine: Any) -> None:
    bad = [
        ({"input_ids": [5] * 5000}, "5000 tokens, but the model's context length is"),
        ({"input_ids": [5, 10**6]}, "token ids must be integers in"),
        ({"input_ids": [5, 6], "sampling_params": {"top_p": 0.0}}, "top_p"),
        ({"input_ids": [5, 6], "sampling_params": {"bogus": 1}}, "bogus"),
        ({"input_ids": [5, 6], "sampling_params": {"min_new_tokens": 9, "max_new_tokens": 2}}, "min_new"),
        ({}, "exactly one of"),
    ]
    for kwargs, message in bad:
        with pytest.raises(InvalidRequestError, match=message):
            engine.generate(**kwargs)
    ok = engine.generate(input_ids=[5, 6, 7], sampling_params={**GREEDY, "max_new_tokens": 3})
    assert len(ok["output_ids"]) == 3


def test_prompt_larger_than_the_kv_pool_is_refused(
    tiny_model_dir: Callable[[str], Path], make_engine: Callable[..., Any]
) -> None:
    engine = make_engine(tiny_model_dir("llama"), max_total_tokens=64)
    with pytest.raises(InvalidRequestError, match="more than the KV cache can ever hold"):
        engine.generate(input_ids=[5] * 100, sampling_params={"max_new_tokens": 2})
    # A prompt that fits but asks for more output than the pool holds finishes at the pool's limit.
    clipped = engine.generate(input_ids=[5] * 40, sampling_params={**GREEDY, "max_new_tokens": 100})
    assert clipped["meta_info"]["finish_reason"]["type"] == "length"
    assert len(clipped["output_ids"]) == 64 - 40


def test_text_prompts_are_tokenized_and_decoded(engine: Any) -> None:
    res = engine.generate(["def main():", "import os"], {**GREEDY, "max_new_tokens": 5})
    assert [len(r["output_ids"]) for r in res] == [5, 5]
    assert all(isinstance(r["text"], str) for r in res)
    assert res[0]["meta_info"]["prompt_tokens"] == len(engine.tokenizer.encode("def main():"))


def test_async_stream_yields_deltas_that_add_up(engine: Any) -> None:
    async def run() -> tuple[list[str], dict[str, Any]]:
        deltas, last = [], {}
        async for chunk in engine.async_stream("def main():", {**GREEDY, "max_new_tokens": 8}):
            deltas.append(chunk["delta"])
            last = chunk
        return deltas, last

    deltas, last = asyncio.run(run())
    assert len(deltas) >= 2
    assert (
        "".join(deltas)
        == last["text"]
        == engine.tokenizer.decode(last["output_ids"], skip_special_tokens=True)
    )
    assert last["meta_info"]["finish_reason"]["type"] == "length"


def test_cancelling_a_stream_aborts_the_request(engine: Any) -> None:
    async def run() -> int:
        received = 0
        stream = engine.async_stream(input_ids=[5, 6, 7], sampling_params={**GREEDY, "max_new_tokens": 500})
        async for _ in stream:
            received += 1
            if received == 3:
                break
        await stream.aclose()
        return received

    assert asyncio.run(run()) == 3
    engine.check_kv_invariant()  # waits until idle: the abort freed the request's KV


def test_abort_all_while_running(engine: Any) -> None:
    async def run() -> list[dict[str, Any]]:
        async def one(i: int) -> dict[str, Any]:
            result: dict[str, Any] = {}
            async for chunk in engine.async_stream(
                input_ids=[5 + i] * 30, sampling_params={**GREEDY, "max_new_tokens": 2000}
            ):
                result = chunk
                if len(chunk["output_ids"]) >= 2 and i == 0:
                    engine.abort(abort_all=True)
            return result

        return list(await asyncio.gather(*(one(i) for i in range(3))))

    results = asyncio.run(run())
    assert all(r["meta_info"]["finish_reason"]["type"] == "abort" for r in results)


def test_kv_check_waits_for_idle_instead_of_failing(tiny_model_dir: Callable[[str], Path]) -> None:
    scheduler = build_scheduler(
        ServerArgs(model_path=str(tiny_model_dir("llama")), dtype="float32", max_total_tokens=512)
    )
    scheduler.handle(
        GenerateRequest("busy", [5, 6, 7], SamplingParams.from_dict({**GREEDY, "max_new_tokens": 4}))
    )
    # Asked while a request runs, the check is answered only when the scheduler goes idle.
    assert scheduler.handle(ControlRequest("check", "check_kv_invariant")) == []
    answers = []
    for _ in range(10):
        answers += [out for out in scheduler.step() if isinstance(out, ControlResult)]
        if answers:
            break
    assert answers == [ControlResult("check", True)]
    assert scheduler.is_idle


def test_penalized_greedy_matches_transformers_generate(
    engine: Any, oracle: Callable[[str], GreedyOracle]
) -> None:
    prompt = random_prompts(1, [12], seed=21)[0]
    hf = (
        oracle("llama")
        .model.generate(
            torch.tensor([prompt]),
            do_sample=False,
            repetition_penalty=1.5,
            max_new_tokens=16,
            min_new_tokens=16,
        )[0, len(prompt) :]
        .tolist()
    )
    # min_new_tokens masks EOS exactly as transformers' min_new_tokens does.
    params = {"temperature": 0.0, "repetition_penalty": 1.5, "max_new_tokens": 16, "min_new_tokens": 16}
    ours = engine.generate(input_ids=prompt, sampling_params=params)
    assert ours["output_ids"] == hf


def test_min_new_tokens_suppresses_eos(engine: Any, oracle: Callable[[str], GreedyOracle]) -> None:
    prompt = random_prompts(1, [8], seed=22)[0]
    first = oracle("llama").continue_(prompt, 1)[0]
    # Make the first greedy token a stop token: without min_new_tokens the request ends at once.
    stopped = engine.generate(input_ids=prompt, sampling_params={**GREEDY, "stop_token_ids": [first]})
    assert stopped["output_ids"] == [first]
    held = engine.generate(
        input_ids=prompt,
        sampling_params={**GREEDY, "stop_token_ids": [first], "min_new_tokens": 3, "max_new_tokens": 3},
    )
    assert len(held["output_ids"]) == 3 and first not in held["output_ids"]


def test_stream_interval_batches_tokens_per_output(
    tiny_model_dir: Callable[[str], Path], make_engine: Callable[..., Any]
) -> None:
    engine = make_engine(tiny_model_dir("llama"), stream_interval=4)

    async def run() -> list[int]:
        sizes = []
        async for chunk in engine.async_stream(
            input_ids=[5, 6, 7], sampling_params={**GREEDY, "max_new_tokens": 10}
        ):
            sizes.append(len(chunk["output_ids"]))
        return sizes

    # Every 4 tokens, and the rest at the end.
    assert asyncio.run(run()) == [4, 8, 10]


def test_a_non_streaming_request_is_sent_its_first_token_then_every_50(
    tiny_model_dir: Callable[[str], Path], make_engine: Callable[..., Any]
) -> None:
    """GenerateRequest.stream false (a non-streaming call; Engine.generate's): the first token (its
    time to first token stays true), then every NON_STREAM_OUTPUT_INTERVAL tokens, and the end,
    whatever --stream-interval says; a streaming one keeps the interval."""
    engine = make_engine(tiny_model_dir("llama"))

    async def sizes(stream: bool) -> list[int]:
        req = engine.requests.build([5, 6, 7], {**GREEDY, "max_new_tokens": 120, "ignore_eos": True})
        req.stream = stream
        return [len(state.output_ids) async for state in engine.stream(req)]

    assert NON_STREAM_OUTPUT_INTERVAL == 50
    assert asyncio.run(sizes(False)) == [1, 51, 101, 120]
    assert asyncio.run(sizes(True)) == list(range(1, 121))
    # Engine.generate reads only the end: its output is the same either way.
    result = engine.generate(
        input_ids=[5, 6, 7], sampling_params={**GREEDY, "max_new_tokens": 120, "ignore_eos": True}
    )
    assert isinstance(result, dict) and len(result["output_ids"]) == 120
