"""A chat reply's text as OpenAI's message fields: `reasoning_content` (--reasoning-parser), then
`content` and `tool_calls` (server/tool_calls.py), for a whole reply or delta by delta.

The reasoning block comes off first; the rest is the answer, which is read for tool calls. A reply
whose call is enforced by a grammar holds no reasoning block, so no reasoning parser reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixserve.server.reasoning import ReasoningFormat, ReasoningStream
from radixserve.server.tool_calls import ToolCallDeltas, ToolPlan, tool_call_chunk, tool_call_json
from radixserve.server.tool_parsers import ToolCallDelta


@dataclass(frozen=True)
class ReplyFormat:
    reasoning: ReasoningFormat | None
    tools: ToolPlan

    def message_fields(self, text: str) -> dict[str, Any]:
        """A whole reply's fields."""
        fields: dict[str, Any] = {}
        if self.reasoning is not None:
            fields["reasoning_content"], text = self.reasoning.split(text)
        fields["content"] = text
        if self.tools.active:
            fields["content"], calls = self.tools.parse(text)
            if calls:
                fields["tool_calls"] = [tool_call_json(call) for call in calls]
        return fields

    def stream(self) -> ReplyStream:
        return ReplyStream(
            None if self.reasoning is None else self.reasoning.stream(),
            self.tools.stream() if self.tools.active else None,
        )


@dataclass
class ReplyDelta:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass
class ReplyStream:
    """One choice's text, delta by delta, as reasoning, content and tool-call deltas."""

    reasoning: ReasoningStream | None
    tools: ToolCallDeltas | None
    # The id of each call of this choice, made when its name goes out.
    call_ids: dict[int, str] = field(default_factory=dict)

    def feed(self, delta: str, finished: bool) -> ReplyDelta:
        out = ReplyDelta()
        answer = delta
        if self.reasoning is not None:
            out.reasoning, answer = self.reasoning.feed(delta)
            if finished:
                held_reasoning, held_answer = self.reasoning.finish()
                out.reasoning += held_reasoning
                answer += held_answer
        if self.tools is None:
            out.content = answer
            return out
        out.content, out.calls = self.tools.feed(answer)
        if finished:
            held_content, held_calls = self.tools.finish()
            out.content += held_content
            out.calls += held_calls
        return out

    @property
    def made_calls(self) -> bool:
        return bool(self.call_ids)

    def call_chunks(self, deltas: list[ToolCallDelta]) -> list[dict[str, Any]]:
        return [tool_call_chunk(delta, self.call_ids) for delta in deltas]
