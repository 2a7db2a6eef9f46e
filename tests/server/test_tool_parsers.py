"""--tool-call-parser (server/tool_parsers.py): the calls and content of whole outputs, as the models
write them, and the stream's deltas, which join up to that parse however the output is cut."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.server.tool_parsers import (
    TOOL_CALL_PARSERS,
    ToolCall,
    ToolCallDelta,
    ToolCallFormat,
    tool_call_parser,
)


def call(name: str, **arguments: object) -> ToolCall:
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


QWEN_TWO_CALLS = (
    "I'll check the weather in both cities for you.\n"
    "<tool_call>\n"
    '{"name": "get_current_weather", "arguments": {"location": "San Francisco, CA", "unit": "fahrenheit"}}\n'
    "</tool_call>\n"
    "<tool_call>\n"
    '{"name": "get_current_weather", "arguments": {"location": "Tokyo, Japan", "unit": "celsius"}}\n'
    "</tool_call>"
)
SF_WEATHER = call("get_current_weather", location="San Francisco, CA", unit="fahrenheit")
TOKYO_WEATHER = call("get_current_weather", location="Tokyo, Japan", unit="celsius")

# (parser, output, content, calls): outputs as the models write them.
RECORDED: list[tuple[str, str, str, list[ToolCall]]] = [
    ("qwen25", QWEN_TWO_CALLS, "I'll check the weather in both cities for you.", [SF_WEATHER, TOKYO_WEATHER]),
    ("hermes", QWEN_TWO_CALLS, "I'll check the weather in both cities for you.", [SF_WEATHER, TOKYO_WEATHER]),
    (
        "hermes",
        '<tool_call>\n{"name": "lookup", "arguments": {"city": "Z\\u00fcrich", "tags": ["a", {"b": null}]}}\n'
        "</tool_call>\nDone.",
        "Done.",
        [call("lookup", city="Zürich", tags=["a", {"b": None}])],
    ),
    (
        "qwen25",
        'A <tool_call>{"name":"f","arguments":{"s":"</tool_call> is text in a string?"}}</tool_call> B',
        'A <tool_call>{"name":"f","arguments":{"s":"</tool_call> is text in a string?"}}</tool_call> B',
        [],
    ),
    (
        "llama3",
        '{"name": "get_weather", "parameters": {"city": "San Francisco", "unit": "celsius"}}',
        "",
        [call("get_weather", city="San Francisco", unit="celsius")],
    ),
    (
        "llama3",
        '<|python_tag|>{"name": "get_current_conditions", "parameters": '
        '{"location": "San Francisco, CA", "unit": "Fahrenheit"}}',
        "",
        [call("get_current_conditions", location="San Francisco, CA", unit="Fahrenheit")],
    ),
    (
        "llama3",
        'Let me look that up. <|python_tag|>{"name": "search", '
        '"arguments": {"q": "{braces} and \\"quotes\\""}}; '
        '{"name": "get_time", "parameters": {}}',
        "Let me look that up.",
        [call("search", q='{braces} and "quotes"'), call("get_time")],
    ),
    (
        "llama3",
        '\n {"name": "a", "parameters": {"n": 1.5}}\n{"name": "b", "parameters": {"ok": true}}\n',
        "",
        [call("a", n=1.5), call("b", ok=True)],
    ),
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", '
        '"format": "celsius"}}]',
        "",
        [call("get_current_weather", location="Paris, France", format="celsius")],
    ),
    (
        "mistral",
        'Sure, two lookups.\n[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_population", "arguments": {"city": "Paris", "year": 2020}}]',
        "Sure, two lookups.",
        [call("get_weather", city="Paris"), call("get_population", city="Paris", year=2020)],
    ),
    (
        "pythonic",
        '[get_weather(city="San Francisco", metric="celsius"), get_time(timezone=\'America/Los_Angeles\')]',
        "",
        [
            call("get_weather", city="San Francisco", metric="celsius"),
            call("get_time", timezone="America/Los_Angeles"),
        ],
    ),
    (
        "pythonic",
        ' [search(query="rust \\"async\\" [book]", limit=5, ratio=-0.5, filters={"year": [2020, (2021,)], '
        '"open": True}, cursor=None, note="""a "b] c""", '
        "q='''it's'''), get_time()]\nChecking now.",
        "Checking now.",
        [
            call(
                "search",
                query='rust "async" [book]',
                limit=5,
                ratio=-0.5,
                filters={"year": [2020, [2021]], "open": True},
                cursor=None,
                note='a "b] c',
                q="it's",
            ),
            call("get_time"),
        ],
    ),
]

# (parser, output): calls that do not parse stay in the content as written.
MALFORMED: list[tuple[str, str]] = [
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>'),  # bad JSON
    ("hermes", 'Calling: <tool_call>\n{"name": "f", "arguments": {"a"'),  # unterminated
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n'),  # no end tag
    ("qwen25", '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>'),  # a string
    ("qwen25", '<tool_call>{"arguments": {}}</tool_call>'),  # no name
    ("qwen25", '<tool_call>{"name": "f"}</tool_call>'),  # no arguments
    ("qwen25", '<tool_call>[{"name": "f", "arguments": {}}]</tool_call>'),  # not an object
    ("llama3", '{"name": "f", "parameters": ["a"]}'),
    ("llama3", '{"name": "f", "parameters": {"a": 1}'),  # unterminated
    ("llama3", '{"name": "f", "parameters": {"a": NaN}}'),
    ("llama3", '{"answer": 42}'),
    ("llama3", 'Searching. <|python_tag|>brave_search.call(query="weather")'),  # a built-in tool
    ("llama3", '<|python_tag|>{"name": "f", "parameters": {}'),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {}}, {"name": 3, "arguments": {}}]'),
    ("mistral", "[TOOL_CALLS] get_weather"),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}'),
    ("mistral", "[TOOL_CALLS] []"),
    ("pythonic", "[f(x=y)]"),
    ("pythonic", "[f(1, 2)]"),
    ("pythonic", "[f(**kwargs)]"),
    ("pythonic", "[f(x=1, x=2)]"),
    ("pythonic", "[f(x={1, 2})]"),
    ("pythonic", "[f(x=1e999)]"),
    ("pythonic", '[__import__("os").system("ls")]'),
    ("pythonic", '[f(x=1), g(y=open("/etc/passwd"))]'),
    ("pythonic", "[1, 2, 3]"),
    ("pythonic", "[]"),
    ("pythonic", "[f(x=1)"),
    ("pythonic", "[f(x='''unclosed)]"),
]

PLAIN = [
    "The weather in Paris is 18 °C.\n",
    '  Use a dict like {"a": 1} or a list [1, 2]; fine. <tool <|python [TOOL',
    "",
    " \n",
]


def run(fmt: ToolCallFormat, pieces: list[str]) -> tuple[str, list[ToolCall]]:
    """The stream's deltas for these pieces, joined, checking the deltas' shape on the way."""
    stream = fmt.stream()
    content = ""
    deltas: list[ToolCallDelta] = []
    for piece in pieces:
        more_content, more_deltas = stream.feed(piece)
        content, deltas = content + more_content, deltas + more_deltas
    more_content, more_deltas = stream.finish()
    content, deltas = content + more_content, deltas + more_deltas
    calls: list[ToolCall] = []
    for delta in deltas:
        if delta.index == len(calls):  # a new call: it starts with its name
            assert delta.name is not None, deltas
            calls.append(ToolCall(delta.name, delta.arguments))
        else:
            assert delta.index == len(calls) - 1 and delta.name is None, deltas
            calls[-1] = ToolCall(calls[-1].name, calls[-1].arguments + delta.arguments)
    return content, calls


@pytest.mark.parametrize(("parser", "text", "content", "calls"), RECORDED)
def test_recorded_outputs_parse_into_content_and_calls(
    parser: str, text: str, content: str, calls: list[ToolCall]
) -> None:
    fmt = tool_call_parser(parser)
    assert fmt.parse(text) == (content, calls)
    assert run(fmt, list(text)) == (content, calls)  # one character at a time


@pytest.mark.parametrize(("parser", "text"), MALFORMED)
def test_malformed_calls_stay_text(parser: str, text: str) -> None:
    fmt = tool_call_parser(parser)
    assert fmt.parse(text) == (text, [])
    assert run(fmt, list(text)) == (text, [])


def test_a_malformed_call_beside_a_valid_one_stays_text_alone() -> None:
    text = (
        'Two: <tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": {}</tool_call>'
    )
    assert tool_call_parser("hermes").parse(text) == (
        'Two:<tool_call>{"name": "b", "arguments": {}</tool_call>',
        [call("a")],
    )


@pytest.mark.parametrize("text", PLAIN)
@pytest.mark.parametrize("parser", TOOL_CALL_PARSERS)
def test_plain_text_is_all_content(parser: str, text: str) -> None:
    fmt = tool_call_parser(parser)
    assert fmt.parse(text) == (text, [])
    assert run(fmt, list(text)) == (text, [])


def test_content_goes_out_at_once_and_a_call_in_one_piece_when_it_ends() -> None:
    stream = tool_call_parser("hermes").stream()
    assert stream.feed("Checking the weather") == ("Checking the weather", [])
    assert stream.feed(" now.\n<tool") == (" now.", [])  # "\n<tool" may start a call
    assert stream.feed('_call>\n{"name": "f", "arguments": {"a"') == ("", [])
    assert stream.feed(": 1}}\n</tool_call>\n") == (
        "",
        [ToolCallDelta(0, "f", ""), ToolCallDelta(0, None, '{"a": 1}')],
    )
    assert stream.finish() == ("", [])


def test_an_unknown_parser_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="hermes, llama3, mistral, pythonic, qwen25"):
        tool_call_parser("gpt-oss")


def joined_at(fmt: ToolCallFormat, text: str, cuts: list[int]) -> tuple[str, list[ToolCall]]:
    bounds = sorted({0, len(text), *cuts})
    return run(fmt, [text[start:end] for start, end in itertools.pairwise(bounds)])


@pytest.mark.parametrize("parser", TOOL_CALL_PARSERS)
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_stream_deltas_join_up_to_the_parse_of_recorded_outputs_at_any_cut(
    parser: str, data: st.DataObject
) -> None:
    texts = [text for name, text, *_ in RECORDED if name == parser]
    texts += [text for name, text in MALFORMED if name == parser] + PLAIN
    text = data.draw(st.sampled_from(texts))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    fmt = tool_call_parser(parser)
    assert joined_at(fmt, text, cuts) == fmt.parse(text), (text, cuts)


# Pieces of every format's syntax, to build outputs that are hard to cut.
PIECES = st.sampled_from(
    [
        "<tool_call>", "</tool_call>", "<tool", "_call>", "</", "<|python_tag|>", "<|python", "[TOOL_CALLS]",
        "[TOOL", '{"name": "f", "arguments": {"a": [1]}}', '{"name": "g", "parameters": {}}', "{", "}", "[",
        "]", '"', "'", '"""', "\\", ";", ",", " ", "\n", "f(", "x=1", 'y="]"', ")", "a", "é",
        '<tool_call>{"name": "f", "arguments": {}}</tool_call>', '[f(x=1, y="]"), g()]',
        '[TOOL_CALLS] [{"name": "h", "arguments": {"b": "\\""}}]',
        '<|python_tag|>{"name": "g", "parameters": {}}',
    ]
)  # fmt: skip


@pytest.mark.parametrize("parser", TOOL_CALL_PARSERS)
@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(PIECES, max_size=14), cuts=st.lists(st.integers(0, 120), max_size=10))
def test_stream_deltas_join_up_to_the_parse_of_any_output_at_any_cut(
    parser: str, pieces: list[str], cuts: list[int]
) -> None:
    text = "".join(pieces)
    fmt = tool_call_parser(parser)
    content, calls = fmt.parse(text)
    assert joined_at(fmt, text, [cut for cut in cuts if cut <= len(text)]) == (content, calls), text
    if not calls:
        assert content == text
