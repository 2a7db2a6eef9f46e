"""Tool calling on /v1/chat/completions through a live server: `auto` read by --tool-call-parser
(beside --reasoning-parser), `required` and a named function enforced by a grammar, the 400s,
and a tool loop on the packaged SmolLM2 with the official openai client."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tests.server.conftest import LiveServer

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Za-z]{1,12}$"},
        "unit": {"type": "string", "enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_SCHEMA = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["utc", "cet", "pst"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER_SCHEMA},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_SCHEMA}},
]
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "get_time": TIME_SCHEMA}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def _streamed(client: Any, body: dict[str, Any]) -> tuple[dict[str, str], dict[int, dict[str, str]], str]:
    """A streamed chat's joined (reasoning_content, content), its calls by index (the name from
    the call's first delta, the arguments joined), and its finish reason."""
    texts = {"reasoning_content": "", "content": ""}
    calls: dict[int, dict[str, str]] = {}
    finish = ""
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as answer:
        for line in answer.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                delta = choice["delta"]
                for key in texts:
                    texts[key] += delta.get(key) or ""
                for call in delta.get("tool_calls") or []:
                    if "id" in call:
                        assert call["index"] not in calls, "a call's name goes out once"
                        calls[call["index"]] = {"name": call["function"]["name"], "arguments": ""}
                    calls[call["index"]]["arguments"] += call["function"]["arguments"]
                finish = choice.get("finish_reason") or finish
    return texts, calls, finish


@pytest.mark.parametrize(
    ("parsers", "scripted", "reasoning"),
    [
        # Qwen-style: the reply opens its own <think> block, then a hermes call.
        (
            ("--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"),
            r'<think>[a-z]{3}</think>\n<tool_call>\n\{"name": "get_weather", "arguments": '
            r'\{"city": "[a-z]{3}", "unit": "c"\}\}\n</tool_call>',
            True,
        ),
        # DeepSeek-R1 style (the template opened the block) with pythonic calls.
        (
            ("--tool-call-parser", "pythonic", "--reasoning-parser", "deepseek-r1"),
            r'[a-z]{3}</think>\[get_weather\(city="[a-z]{3}", unit="c"\)\]',
            True,
        ),
    ],
)
def test_auto_calls_come_apart_from_reasoning_streamed_or_not(
    tiny_model_dir: Callable[[str], Path],
    start_server: Callable[..., LiveServer],
    parsers: tuple[str, ...],
    scripted: str,
    reasoning: bool,
) -> None:
    """A grammar makes the tiny model write a reasoning block and a call; both parsers read it."""
    server = start_server(tiny_model_dir("llama"), *parsers)
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 200, "temperature": 0, "regex": scripted}
    with server.client() as client:
        choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        message = choice["message"]
        assert choice["finish_reason"] == "tool_calls"
        assert len(message["reasoning_content"]) == 3 and message["reasoning_content"].isalpha()
        assert message["content"] is None
        [call] = message["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["function"]["name"] == "get_weather"
        arguments = json.loads(call["function"]["arguments"])
        assert arguments["unit"] == "c" and len(arguments["city"]) == 3
        texts, calls, finish = _streamed(client, body)
    assert texts == {"reasoning_content": message["reasoning_content"], "content": ""}
    assert calls == {0: {"name": "get_weather", "arguments": call["function"]["arguments"]}}
    assert finish == "tool_calls"
    server.assert_idle_and_kv_intact()


# Shows what a template is given: the tools' names, and a call's arguments as an object.
TOOLS_TEMPLATE = (
    "{% if tools %}[{% for t in tools %}{{ t.function.name }};{% endfor %}]{% endif %}"
    "{% for m in messages %}<{{ m.role }}:{{ m.content }}"
    "{% for c in m.tool_calls or [] %}{{ c.function.name }}({{ c.function.arguments.city }}){% endfor %}"
    "{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %}>{% endfor %}"
)


def test_required_and_named_calls_validate_and_malformed_auto_calls_stay_text(
    tiny_model_dir: Callable[[str], Path], start_server: Callable[..., LiveServer]
) -> None:
    server = start_server(
        tiny_model_dir("llama"), "--tool-call-parser", "hermes", "--chat-template", TOOLS_TEMPLATE
    )
    base = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 120, "temperature": 1.0, "seed": 3, "n": 8}
    named = {"type": "function", "function": {"name": "get_time"}}
    with server.client() as client:
        # A random model need not close a JSON array; one call per reply keeps it bounded (SmolLM2
        # below runs parallel calls).
        one = {**base, "tool_choice": "required", "parallel_tool_calls": False}
        for choice in client.post("/v1/chat/completions", json=one).json()["choices"]:
            assert choice["finish_reason"] == "tool_calls", choice
            [call] = choice["message"]["tool_calls"]
            name = call["function"]["name"]
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])
        for choice in client.post("/v1/chat/completions", json={**base, "tool_choice": named}).json()[
            "choices"
        ]:
            [call] = choice["message"]["tool_calls"]
            assert call["function"]["name"] == "get_time"
            jsonschema.validate(json.loads(call["function"]["arguments"]), TIME_SCHEMA)
        # Streamed, a named call's name goes out first and its arguments join up to valid JSON.
        single = {**base, "n": 1, "tool_choice": named}
        _, calls, finish = _streamed(client, single)
        assert calls[0]["name"] == "get_time" and finish == "tool_calls"
        jsonschema.validate(json.loads(calls[0]["arguments"]), TIME_SCHEMA)

        # The template sees the tools and the history's calls (arguments as an object), in chat
        # completions and /tokenize alike.
        call = {
            "id": "c1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
        }
        history = [
            *MESSAGES,
            {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "9"},
        ]
        ids = client.post(
            "/tokenize", json={"messages": history, "tools": TOOLS, "add_generation_prompt": False}
        )
        text = client.post("/detokenize", json={"tokens": ids.json()["tokens"]}).json()["prompt"]
        rendered = "<user:What is the weather in Paris?><assistant:get_weather(Oslo)><tool:9#c1>"
        assert text == "[get_weather;get_time;]" + rendered
        usage = client.post(
            "/v1/chat/completions",
            json={**base, "messages": history, "n": 1, "max_tokens": 1, "tool_choice": named},
        ).json()["usage"]
        assert usage["prompt_tokens"] == ids.json()["count"]

        # Under auto, a call the model gets wrong comes back as text, never as a 500.
        broken = r'<tool_call>\n\{"name": get_weather\}\n</tool_call>'
        body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 120, "temperature": 0, "regex": broken}
        choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        assert "tool_calls" not in choice["message"] and choice["finish_reason"] == "stop"
        assert choice["message"]["content"] == '<tool_call>\n{"name": get_weather}\n</tool_call>'
        texts, calls, _ = _streamed(client, body)
        assert texts["content"] == choice["message"]["content"] and not calls
    server.assert_idle_and_kv_intact()


SHARED_SERVER = True


@pytest.mark.parametrize(
    ("change", "param", "fragment"),
    [
        ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs 'tools'"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not among"),
        ({"tool_choice": "sometimes"}, "tool_choice", "must be 'none'"),
        ({"tool_choice": "auto"}, "tool_choice", "--tool-call-parser"),
        ({"tool_choice": "required", "regex": "a+"}, "tool_choice", "grammar"),
        ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "tools", "distinct"),
    ],
)
def test_tool_requests_the_server_cannot_serve_are_400s(
    server: LiveServer, change: dict[str, Any], param: str, fragment: str
) -> None:
    """The shared server has no --tool-call-parser."""
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 4, **change}
    with server.client() as client:
        answer = client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and fragment in error["message"]


def test_a_tool_without_a_function_is_a_422_naming_it(server: LiveServer) -> None:
    """A body of the wrong shape is a 422, as every other field's (docs/server.md)."""
    body = {"messages": MESSAGES, "tools": [{"type": "function"}], "max_tokens": 4}
    with server.client() as client:
        answer = client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 422 and "tools" in answer.json()["error"]["message"]


def test_tool_choice_none_answers_in_text(server: LiveServer) -> None:
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "none", "max_tokens": 4, "temperature": 0}
    with server.client() as client:
        choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert "tool_calls" not in choice["message"] and isinstance(choice["message"]["content"], str)


def test_a_tool_loop_on_the_default_model_with_the_openai_client(
    smollm2_gguf_path: Path, start_server: Callable[..., LiveServer]
) -> None:
    """The packaged SmolLM2: 50 seeded samples at temperature 1 for each of `required` and a named
    function, each call valid against its schema; then the call and its result go back as history
    and the model answers."""
    server = start_server(None, "--served-model-name", "default")
    client = server.openai()
    tools: Any = TOOLS
    for choice_arg in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        # One call per reply: this 135M model, left to add calls, often repeats them until
        # max_tokens, and a reply cut short is returned as text.
        completion = client.chat.completions.create(
            model="default", messages=MESSAGES, tools=tools, tool_choice=choice_arg,  # type: ignore[arg-type]
            parallel_tool_calls=False, temperature=1.0, seed=7, n=50, max_tokens=100,
        )  # fmt: skip
        assert len(completion.choices) == 50
        for choice in completion.choices:
            calls = choice.message.tool_calls or []
            assert calls, choice
            for call in calls:
                function = call.function  # type: ignore[union-attr]
                jsonschema.validate(json.loads(function.arguments), SCHEMAS[function.name])
                if choice_arg != "required":
                    assert function.name == "get_weather"
    call = completion.choices[0].message.tool_calls[0]  # type: ignore[index]
    history: Any = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    answer = client.chat.completions.create(
        model="default", messages=history, tools=tools, tool_choice="none", temperature=0, max_tokens=24
    )
    assert answer.choices[0].message.content and answer.choices[0].finish_reason in ("stop", "length")
    assert not answer.choices[0].message.tool_calls
    server.assert_idle_and_kv_intact()
