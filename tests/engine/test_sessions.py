"""Sessions: a conversation through session_params equals sending the whole context each time."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from radixserve.protocol.sampling_params import InvalidRequestError
from tests.engine.oracle import GREEDY

PARAMS: dict[str, Any] = {**GREEDY, "max_new_tokens": 6}


@pytest.fixture
def engine(tiny_model_dir: Callable[[str], Path], make_engine: Callable[..., Any]) -> Any:
    return make_engine(tiny_model_dir("llama"), max_total_tokens=2048)


def turn(engine: Any, ids: list[int], session: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
    req = engine.requests.build(ids, PARAMS, return_logprob=True, session_params=session, **kw)
    box: list[dict[str, Any]] = []

    async def run() -> None:
        async for state in engine.stream(req):
            if state.finished:
                box.append(state.to_dict())

    asyncio.run(run())
    return box[0]


def test_multi_turn_session_equals_full_context(engine: Any) -> None:
    session = engine.open_session()
    turns = [[5, 6, 7], [8, 9], [10, 11, 12]]
    history: list[int] = []
    for ids in turns:
        in_session = turn(engine, ids, {"id": session})
        full = engine.generate(input_ids=history + ids, sampling_params=PARAMS, return_logprob=True)
        assert in_session["output_ids"] == full["output_ids"]
        ours = [v for v, _, _ in in_session["meta_info"]["output_token_logprobs"]]
        assert ours == pytest.approx([v for v, _, _ in full["meta_info"]["output_token_logprobs"]], abs=1e-5)
        assert in_session["meta_info"]["prompt_tokens"] == len(history) + len(ids)
        if history:
            # The earlier turns' tokens come from the radix cache.
            assert in_session["meta_info"]["cached_tokens"] >= len(history) - 1
        history += ids + in_session["output_ids"]
    engine.close_session(session)


def test_branching_and_misuse(engine: Any) -> None:
    session = engine.open_session("chat-1")
    first = turn(engine, [5, 6, 7], {"id": session}, rid="t1")
    turn(engine, [8], {"id": session}, rid="t2")
    # Branch off t1 after its first 4 tokens (prompt + one output token).
    branch = turn(engine, [9, 9], {"id": session, "rid": "t1", "offset": 4, "replace": True})
    expected = engine.generate(input_ids=[5, 6, 7, first["output_ids"][0], 9, 9], sampling_params=PARAMS)
    assert branch["output_ids"] == expected["output_ids"]
    with pytest.raises(InvalidRequestError, match="is not a finished request"):
        turn(engine, [1], {"id": session, "rid": "t2"})  # replaced by the branch
    with pytest.raises(InvalidRequestError, match="past the end"):
        turn(engine, [1], {"id": session, "rid": "t1", "offset": 999})
    with pytest.raises(InvalidRequestError, match="already open"):
        engine.open_session("chat-1")
    engine.close_session(session)
    with pytest.raises(InvalidRequestError, match="is not open"):
        turn(engine, [1], {"id": session})
    with pytest.raises(InvalidRequestError, match="session_params must be"):
        turn(engine, [1], {"rid": "x"})
