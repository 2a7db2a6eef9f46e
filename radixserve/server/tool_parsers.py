"""--tool-call-parser: the tool calls in a model's chat output, split from its text, as
OpenAI-compatible servers return them (`tool_calls` beside `content`, in messages and stream deltas).
The names are those SGLang and vLLM give the same formats:

- `hermes`, `qwen25`: each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  (newlines around the JSON as the models write them); there may be several, with text around them.
- `llama3`: Llama 3.1/3.2 JSON calls, `{"name": ..., "parameters": {...}}` ("arguments" is accepted
  too). A call is recognised after the `<|python_tag|>` token's text, or when the output itself starts
  with `{` (after whitespace); further calls may follow, separated by `;` or whitespace.
- `mistral`: `[TOOL_CALLS]` and then a JSON array of `{"name": ..., "arguments": {...}}` objects (a
  lone object is accepted too); the text before it is content.
- `pythonic`: Llama 4 style, an output that starts (after whitespace) with a Python list of calls,
  `[get_weather(city="Paris"), add(a=1, b=2)]`. It is read with `ast`, never run: only keyword
  arguments whose values are literals (`ast.literal_eval`) that JSON can hold.

A call is a name (a non-empty string) and an arguments object (a key is required: a JSON object
that merely has a "name" is too likely to be an answer). Its `arguments` are that object as
`json.dumps(..., ensure_ascii=False)` writes it, whatever spacing the model used.

Content: everything that is not a valid call, verbatim, except the whitespace that only separates a
call from what is around it (the runs right before its marker or opening bracket and right after
its end; for llama3 also the `;` after it). A call that does not parse (bad JSON, no name,
arguments that are not an object, an unterminated tag or bracket, a non-literal argument) stays in
the content exactly as written, with the whitespace before it, and is never an error. So an output
without a valid call comes back unchanged.

Streaming: a stream holds back only text that may still turn out to start a call (a suffix that
could begin a marker, and the whitespace before it), so content goes out promptly. Once a call has
begun, its text is held until the call is complete (its end tag, its closing bracket, or the end of
the output); then it goes out as one delta with the call's name and one with all of its arguments,
or as content if it turned out malformed. Arguments are deliberately not streamed piece by piece:
sending them early would commit to a call that may yet have to be returned as text. `parse` is the
stream fed the whole output at once, and every decision the stream makes depends only on the text,
never on where it was cut, so any cut's deltas join up to `parse`'s result.
"""

from __future__ import annotations

import ast
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from radixserve.config.server_args import TOOL_CALL_PARSERS
from radixserve.runtime.detokenizer import held_back_length

ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object


@dataclass(frozen=True)
class ToolCallDelta:
    index: int  # the call's position among this output's calls
    name: str | None  # on the call's first delta only
    arguments: str  # a piece of the arguments' JSON text


def _reject_constant(name: str) -> Any:
    # json.loads takes NaN and Infinity, which json.dumps would write back as invalid JSON.
    raise ValueError(f"{name} is not JSON")


def _load_json(text: str) -> Any:
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return None


def _json_call(obj: Any) -> ToolCall | None:
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    arguments = next((obj[key] for key in ARGUMENT_KEYS if key in obj), None)
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def _one_json_call(text: str) -> list[ToolCall] | None:
    call = _json_call(_load_json(text))
    return None if call is None else [call]


def _json_call_list(text: str) -> list[ToolCall] | None:
    value = _load_json(text)
    items = value if isinstance(value, list) else [value]
    calls = [_json_call(item) for item in items]
    # All or nothing: a half-valid array goes back as the text it was.
    if not calls or any(call is None for call in calls):
        return None
    return [call for call in calls if call is not None]


def _jsonable(value: Any) -> Any:
    """A literal as JSON can hold it (tuples as lists); ValueError for sets, bytes, complex, inf."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("not a finite number")
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(item) for item in value]
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        return {key: _jsonable(item) for key, item in value.items()}
    raise ValueError(f"{type(value).__name__} is not JSON")


def _pythonic_calls(text: str) -> list[ToolCall] | None:
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        # Positional arguments have no parameter names to map to, so they make the call malformed.
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        arguments: dict[str, Any] = {}
        for keyword in node.keywords:
            if keyword.arg is None or keyword.arg in arguments:  # **kwargs, or a name given twice
                return None
            try:
                arguments[keyword.arg] = _jsonable(ast.literal_eval(keyword.value))
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                return None
        calls.append(ToolCall(node.func.id, json.dumps(arguments, ensure_ascii=False)))
    return calls


class _Closer:
    """Finds where a bracketed value that starts at `pos` closes, skipping brackets in strings.

    It only counts brackets (a mismatched one just makes the value fail to parse later), and it
    resumes where it stopped, so a call arriving in many pieces is scanned once."""

    def __init__(self, python: bool, pos: int):
        self.quotes = "\"'" if python else '"'
        self.python = python
        self.pos = pos
        self.depth = 0
        self.quote = ""  # the open string's delimiter; "" outside strings
        self.escaped = False

    def run(self, text: str) -> int | None:
        """The end (exclusive) of the value in text, or None until more text comes."""
        i, size = self.pos, len(text)
        while i < size:
            char = text[i]
            if self.quote:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == self.quote[0]:
                    if len(self.quote) == 3 and size - i < 3:
                        break  # may be the start of the closing triple quote: wait and see
                    if text.startswith(self.quote, i):
                        i += len(self.quote)
                        self.quote = ""
                        continue
            elif char in self.quotes:
                if self.python and size - i < 3:
                    break  # a Python string may open with a triple quote: wait and see
                self.quote = char * 3 if self.python and text.startswith(char * 3, i) else char
                i += len(self.quote)
                continue
            elif char in "[{(":
                self.depth += 1
            elif char in "]})":
                self.depth -= 1
                if self.depth == 0:
                    self.pos = i + 1
                    return i + 1
            i += 1
        self.pos = i
        return None


@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    marker: str | None  # the text that starts a call anywhere in the output
    end_tag: str | None  # the text that ends a call begun by the marker (else a bracket does)
    openers: str  # the brackets that may begin the value after the marker
    bare_opener: str | None  # the bracket that starts a call when the output begins with it
    python: bool  # the value is Python (quotes) rather than JSON
    chained: bool  # after a call, another `{` may follow, past whitespace and one `;` (llama3)
    decode: Callable[[str], list[ToolCall] | None]  # a call's text (no marker or tag) to its calls

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a whole output; see the module docstring for the content rule."""
        stream = self.stream()
        content, deltas = stream.feed(text)
        more_content, more_deltas = stream.finish()
        calls: list[ToolCall] = []
        for delta in deltas + more_deltas:
            if delta.name is not None:
                calls.append(ToolCall(delta.name, delta.arguments))
            else:
                calls[-1] = ToolCall(calls[-1].name, calls[-1].arguments + delta.arguments)
        return content + more_content, calls

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)


def _hermes(name: str) -> ToolCallFormat:
    return ToolCallFormat(
        name, "<tool_call>", "</tool_call>", "", None, python=False, chained=False, decode=_one_json_call
    )


FORMATS = {
    "hermes": _hermes("hermes"),
    "qwen25": _hermes("qwen25"),
    "llama3": ToolCallFormat(
        "llama3", "<|python_tag|>", None, "{", "{", python=False, chained=True, decode=_one_json_call
    ),
    "mistral": ToolCallFormat(
        "mistral", "[TOOL_CALLS]", None, "[{", None, python=False, chained=False, decode=_json_call_list
    ),
    "pythonic": ToolCallFormat(
        "pythonic", None, None, "", "[", python=True, chained=False, decode=_pythonic_calls
    ),
}


def tool_call_parser(name: str) -> ToolCallFormat:
    if name not in FORMATS:
        raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got {name!r}")
    return FORMATS[name]


class ToolCallStream:
    """One output's text, delta by delta, as (content, tool call) deltas."""

    def __init__(self, fmt: ToolCallFormat):
        self.fmt = fmt
        # "start": nothing but whitespace yet (a bare call may come); "text": content, watching for
        # the marker; "call": holding a call's text; "after": a call just ended, the whitespace
        # after it is dropped; "chain": llama3, past the `;` after a call.
        self.state = "start" if fmt.bare_opener else "text"
        self.pending = ""  # text not yet decided (in "call": the call's text, from its marker on)
        self.gap = ""  # the whitespace before the call being held: dropped, or content if malformed
        self.head = 0  # length of the held call's marker
        self.searched = 0  # how far the held call's text was searched for its end tag
        self.closer: _Closer | None = None  # the held call's bracket scanner, once its value began
        self.index = 0  # the next call's index
        self.content: list[str] = []
        self.deltas: list[ToolCallDelta] = []

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        self.pending += delta
        while self._step():
            pass
        return self._out()

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """The held-back text at the end of the output: no call began, or one never ended."""
        # In "after" and "chain" the pending text is only whitespace and separators, which go.
        if self.state in ("start", "text", "call"):
            self.content.append(self.gap + self.pending)
        self.pending, self.gap, self.state = "", "", "text"
        return self._out()

    def _out(self) -> tuple[str, list[ToolCallDelta]]:
        content, deltas = "".join(self.content), self.deltas
        self.content, self.deltas = [], []
        return content, deltas

    def _step(self) -> bool:
        """Moves on as far as the text decides; False when it needs more text."""
        if self.state == "start":
            return self._start()
        if self.state == "text":
            return self._text()
        if self.state == "call":
            return self._call()
        return self._after()

    def _start(self) -> bool:
        body = self.pending.lstrip()
        if not body:
            return False
        if body[0] == self.fmt.bare_opener:
            self.gap, self.pending = self.pending[: len(self.pending) - len(body)], body
            self._open_call(0)
        else:
            self.state = "text"
        return True

    def _text(self) -> bool:
        marker = self.fmt.marker
        if marker is None:
            self.content.append(self.pending)
            self.pending = ""
            return False
        at = self.pending.find(marker)
        if at < 0:
            # Hold back what may begin the marker, and the whitespace before it, which would go
            # with a call.
            cut = len(self.pending) - held_back_length(self.pending, [marker])
            cut = len(self.pending[:cut].rstrip())
            self.content.append(self.pending[:cut])
            self.pending = self.pending[cut:]
            return False
        text = self.pending[:at].rstrip()
        self.content.append(text)
        self.gap, self.pending = self.pending[len(text) : at], self.pending[at:]
        self._open_call(len(marker))
        return True

    def _open_call(self, head: int) -> None:
        self.state, self.head, self.searched = "call", head, head
        # A bare call's value starts at once; after a marker, it starts past the whitespace.
        self.closer = _Closer(self.fmt.python, 0) if head == 0 else None

    def _call(self) -> bool:
        end = self._call_end()
        if end is None:
            return False
        text, self.pending = self.pending[:end], self.pending[end:]
        tail = len(self.fmt.end_tag) if self.fmt.end_tag else 0
        calls = self.fmt.decode(text[self.head : len(text) - tail])
        if calls:
            for call in calls:
                self.deltas.append(ToolCallDelta(self.index, call.name, ""))
                self.deltas.append(ToolCallDelta(self.index, None, call.arguments))
                self.index += 1
            self.state = "after"
        else:
            self.content.append(self.gap + text)
            self.state = "text"
        self.gap = ""
        return True

    def _call_end(self) -> int | None:
        """Where the held call's text ends, or None until more text comes."""
        end_tag = self.fmt.end_tag
        if end_tag is not None:
            at = self.pending.find(end_tag, max(self.head, self.searched - len(end_tag) + 1))
            if at < 0:
                self.searched = len(self.pending)
                return None
            return at + len(end_tag)
        if self.closer is None:
            value = self.pending[self.head :].lstrip()
            if not value:
                return None
            if value[0] not in self.fmt.openers:
                return self.head  # the marker alone, which decodes to nothing and stays text
            self.closer = _Closer(self.fmt.python, len(self.pending) - len(value))
        return self.closer.run(self.pending)

    def _after(self) -> bool:
        self.pending = self.pending.lstrip()
        if not self.pending:
            return False
        if self.fmt.chained and self.state == "after" and self.pending[0] == ";":
            self.pending, self.state = self.pending[1:], "chain"
        elif self.fmt.chained and self.pending[0] == "{":
            self._open_call(0)
        else:
            self.state = "text"
        return True
