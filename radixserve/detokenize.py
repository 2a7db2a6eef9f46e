"""Incremental detokenization: text deltas from a growing list of token ids.

Decoding the whole output on every step is O(n²) over a long generation. Instead each request keeps
two offsets: the unread tokens are decoded together with the tokens of the previous delta (so that
tokenizers which merge spaces or bytes across tokens see their left context), and only the new part
is emitted. A
delta ending in U+FFFD is held back: it is a multi-byte character split across tokens, and the
next token completes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

REPLACEMENT_CHAR = "\ufffd"


@dataclass
class IncrementalDetokenizer:
    tokenizer: Any
    skip_special_tokens: bool = True
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""

    def push(self, new_ids: list[int], final: bool = False) -> str:
        """Adds tokens; returns the text that became complete (everything left, when final)."""
        self.ids.extend(new_ids)
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        prefix_text = decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=skip)
        full_text = decode(self.ids[self.prefix_offset :], skip_special_tokens=skip)
        if len(full_text) <= len(prefix_text) or (full_text.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        delta = full_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta
