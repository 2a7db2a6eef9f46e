"""--reasoning-parser: a reasoning model's thinking, split from its answer, as OpenAI-compatible
servers return it (`reasoning_content` beside `content`, in messages and stream deltas).

Both formats wrap the thinking in <think> … </think>:
- `deepseek-r1`: the chat template opens the block in the prompt, so the output starts inside it
  (a leading <think> is dropped too); without a </think>, everything is reasoning.
- `qwen3`: the output opens the block itself; output that does not start with <think> (after
  whitespace) is all answer, as with chat_template_kwargs {"enable_thinking": false}.
The stream holds back any text that could still turn out to be a tag, so its deltas join up to
the non-streaming split whatever the chunking.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.config.server_args import REASONING_PARSERS
from radixserve.runtime.detokenizer import held_back_length

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    starts_inside: bool  # the output begins inside the block (deepseek-r1)

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None, answer) of a whole output."""
        stream = self.stream()
        reasoning, content = stream.feed(text)
        more_reasoning, more_content = stream.finish()
        reasoning += more_reasoning
        content += more_content
        return (reasoning if stream.had_reasoning else None), content

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)


def reasoning_format(name: str) -> ReasoningFormat:
    if name not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}, got {name!r}")
    return ReasoningFormat(starts_inside=name == "deepseek-r1")


class ReasoningStream:
    """One output's text, delta by delta, as (reasoning, answer) deltas."""

    def __init__(self, fmt: ReasoningFormat):
        # "open": before any text is known (a leading <think> may come); "reasoning"; "after_end"
        # (the block closed, its newlines not yet past); "answer".
        self.state = "open"
        self.inside_first = fmt.starts_inside
        self.pending = ""  # text held back: it may be the start of a tag
        self.had_reasoning = fmt.starts_inside

    def feed(self, delta: str) -> tuple[str, str]:
        self.pending += delta
        reasoning = content = ""
        while True:
            if self.state == "open":
                stripped = self.pending.lstrip()
                if stripped.startswith(START):
                    self.pending, self.state, self.had_reasoning = stripped[len(START) :], "reasoning", True
                    continue
                if START.startswith(stripped):
                    return reasoning, content  # still possibly <think>
                self.state = "reasoning" if self.inside_first else "answer"
                continue
            if self.state == "after_end":
                # The newlines right after </think> belong to neither part, however they arrive.
                self.pending = self.pending.lstrip("\n")
                if not self.pending:
                    return reasoning, content
                self.state = "answer"
            if self.state == "answer":
                content += self.pending
                self.pending = ""
                return reasoning, content
            at = self.pending.find(END)
            if at >= 0:
                reasoning += self.pending[:at]
                self.pending, self.state = self.pending[at + len(END) :], "after_end"
                continue
            keep = held_back_length(self.pending, [END])
            reasoning += self.pending[: len(self.pending) - keep]
            self.pending = self.pending[len(self.pending) - keep :]
            return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The held-back text at the end of the output (no tag came after all)."""
        held, self.pending = self.pending, ""
        if self.state == "reasoning" or (self.state == "open" and self.inside_first):
            return held, ""
        return "", held
