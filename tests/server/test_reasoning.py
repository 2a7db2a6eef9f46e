"""--reasoning-parser (server/reasoning.py): the split of a whole output, and the stream's deltas,
which join up to that split however the output is cut."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.server.reasoning import reasoning_format

CASES = {
    "<think>abc</think>xyz": {"qwen3": ("abc", "xyz"), "deepseek-r1": ("abc", "xyz")},
    "  <think>\nabc</think>\n\nxyz": {"qwen3": ("\nabc", "xyz"), "deepseek-r1": ("\nabc", "xyz")},
    "plain answer": {"qwen3": (None, "plain answer"), "deepseek-r1": ("plain answer", "")},
    "abc</think>xyz": {"qwen3": (None, "abc</think>xyz"), "deepseek-r1": ("abc", "xyz")},
    "<think>unfinished</thi": {"qwen3": ("unfinished</thi", ""), "deepseek-r1": ("unfinished</thi", "")},
    "<thi": {"qwen3": (None, "<thi"), "deepseek-r1": ("<thi", "")},
}


@pytest.mark.parametrize("text", list(CASES))
@pytest.mark.parametrize("parser", ["qwen3", "deepseek-r1"])
def test_a_whole_output_splits_into_reasoning_and_answer(text: str, parser: str) -> None:
    assert reasoning_format(parser).split(text) == CASES[text][parser]


PIECES = st.sampled_from(["<think>", "</think>", "<th", "ink>", "</", "a", "bc", "\n", " ", "<", ">"])


@settings(max_examples=2000, deadline=None)
@given(pieces=st.lists(PIECES, max_size=12), cuts=st.lists(st.integers(0, 80), max_size=8))
def test_stream_deltas_join_up_to_the_split_at_any_cut(pieces: list[str], cuts: list[int]) -> None:
    text = "".join(pieces)
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    for parser in ("qwen3", "deepseek-r1"):
        fmt = reasoning_format(parser)
        stream = fmt.stream()
        reasoning = content = ""
        for start, end in itertools.pairwise(bounds):
            r, c = stream.feed(text[start:end])
            reasoning, content = reasoning + r, content + c
        r, c = stream.finish()
        reasoning, content = reasoning + r, content + c
        expected_reasoning, expected_content = fmt.split(text)
        assert (reasoning, content) == (expected_reasoning or "", expected_content), (parser, text, bounds)
