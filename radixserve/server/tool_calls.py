"""Tool calling on /v1/chat/completions: what `tools` and `tool_choice` ask for, how the reply's
text becomes `tool_calls`, streamed or not.

- `none`: the tools are not shown to the model and nothing is parsed.
- `auto` (the default with tools): the tools go to the chat template as transformers passes them,
  and --tool-call-parser finds calls in the reply; a call that does not parse stays text. The
  output is not constrained: the parsers' formats differ per model family, and a grammar that only
  starts at a call's opening tag would need each format's trigger; a malformed call costs the
  client a retry, never a 500.
- `required` and a named function are enforced by a grammar (xgrammar, through the request's
  json_schema): `required` makes the reply a JSON array of {"name", "parameters"} objects, one of
  the tools each, whose parameters validate against that tool's schema (at most one element when
  parallel_tool_calls is false); a named function makes the reply that function's arguments
  object. Neither needs a parser, so they work with any model.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from radixserve.server.errors import ApiError
from radixserve.server.openai_protocol import ChatCompletionRequest, NamedToolChoice, Tool
from radixserve.server.tool_parsers import ToolCall, ToolCallDelta, ToolCallFormat, tool_call_parser

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call_json(call: ToolCall) -> dict[str, Any]:
    """One call as OpenAI's message.tool_calls holds it."""
    return {
        "id": new_call_id(),
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


@dataclass(frozen=True)
class ToolPlan:
    """What one chat request asked of its tools: mode is none, auto, required or named."""

    mode: str
    tools: list[Tool] = field(default_factory=list)
    parser: ToolCallFormat | None = None  # set for auto only
    named: str | None = None
    parallel: bool = True

    @property
    def active(self) -> bool:
        """Whether the reply is read for tool calls."""
        return self.mode != "none"

    @property
    def constrained(self) -> bool:
        """Whether a grammar makes the whole reply a call (the reply then holds no reasoning)."""
        return self.mode in ("required", "named")

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as chat templates take them (None: the template is told of no tools)."""
        if not self.active:
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    def grammar(self) -> dict[str, str] | None:
        """The json_schema that enforces a required or named call, None for the other modes."""
        schemas = {tool.function.name: tool.function.parameters or ANY_OBJECT for tool in self.tools}
        if self.mode == "named":
            assert self.named is not None
            return {"json_schema": json.dumps(schemas[self.named])}
        if self.mode != "required":
            return None
        one_call = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"enum": [name]}, "parameters": schema},
                    "required": ["name", "parameters"],
                }
                for name, schema in schemas.items()
            ]
        }
        array: dict[str, Any] = {"type": "array", "items": one_call, "minItems": 1}
        if not self.parallel:
            array["maxItems"] = 1
        return {"json_schema": json.dumps(array)}

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole reply; content None when the reply is calls alone."""
        if self.mode == "named":
            assert self.named is not None
            return None, [ToolCall(self.named, text)]
        if self.mode == "required":
            calls = _required_calls(text)
            return (text, []) if calls is None else (None, calls)
        assert self.parser is not None  # plan_tools gives auto a parser
        content, calls = self.parser.parse(text)
        return (content or None) if calls else content, calls

    def stream(self) -> ToolCallDeltas:
        return ToolCallDeltas(self)


def _required_calls(text: str) -> list[ToolCall] | None:
    """The calls of a `required` reply (a JSON array of {name, parameters}); None when it is not
    one (the grammar was cut short by max_tokens)."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(items, list) or not items:
        return None
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        calls.append(ToolCall(item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False)))
    return calls


class ToolCallDeltas:
    """One reply's text, delta by delta, as (content delta, call deltas): a named function's
    arguments stream as they come; `required` calls come out whole at the end (a JSON array is
    only known to be calls once it closes); `auto` follows the parser's stream."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.parser_stream = plan.parser.stream() if plan.parser is not None else None
        self.held = ""
        self.named_started = False

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        plan = self.plan
        if plan.mode == "named":
            deltas = []
            if not self.named_started:
                self.named_started = True
                deltas.append(ToolCallDelta(0, plan.named, ""))
            if delta:
                deltas.append(ToolCallDelta(0, None, delta))
            return "", deltas
        if plan.mode == "required":
            self.held += delta
            return "", []
        assert self.parser_stream is not None  # auto: plan_tools gave it a parser
        return self.parser_stream.feed(delta)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        plan = self.plan
        if plan.mode == "named":
            return self.feed("")
        if plan.mode == "required":
            calls = _required_calls(self.held)
            if calls is None:
                return self.held, []
            deltas = []
            for index, call in enumerate(calls):
                deltas += [ToolCallDelta(index, call.name, ""), ToolCallDelta(index, None, call.arguments)]
            return "", deltas
        assert self.parser_stream is not None
        return self.parser_stream.finish()


def plan_tools(body: ChatCompletionRequest, parser_name: str | None) -> ToolPlan:
    """The request's tool plan, with a 400 for a choice it cannot have."""
    tools = body.tools or []
    choice = body.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise ApiError(400, "tool_choice needs 'tools'", param="tool_choice")
        return ToolPlan("none")
    names = [tool.function.name for tool in tools]
    if len(set(names)) != len(names):
        raise ApiError(400, "tools must have distinct function names", param="tools")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise ApiError(
                400,
                f"tool_choice names function {choice.function.name!r}, which is not among the tools",
                param="tool_choice",
            )
        return ToolPlan("named", tools, named=choice.function.name)
    mode = "auto" if choice is None else choice
    if mode not in ("none", "auto", "required"):
        raise ApiError(
            400,
            "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": "
            '{"name": ...}}',
            param="tool_choice",
        )
    if mode == "auto" and parser_name is None:
        raise ApiError(
            400,
            "tool_choice 'auto' needs the server started with --tool-call-parser (e.g. hermes); "
            "'required' and a named function work without it",
            param="tool_choice",
        )
    # Only auto reads the reply with the parser.
    parser = tool_call_parser(parser_name) if mode == "auto" and parser_name is not None else None
    return ToolPlan(mode, tools, parser, parallel=body.parallel_tool_calls)


def tool_call_chunk(delta: ToolCallDelta, call_ids: dict[int, str]) -> dict[str, Any]:
    """A stream delta's tool_calls entry: the first of a call carries its id, type and name."""
    entry: dict[str, Any] = {"index": delta.index}
    function: dict[str, Any] = {"arguments": delta.arguments}
    if delta.name is not None:
        call_ids[delta.index] = new_call_id()
        entry.update(id=call_ids[delta.index], type="function")
        function["name"] = delta.name
    entry["function"] = function
    return entry
