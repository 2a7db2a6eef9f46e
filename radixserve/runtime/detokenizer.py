"""The detokenizer: token ids from the scheduler in, text deltas to the engine out.

Decoding the whole output on every step would be O(n²) over a long generation. Instead each request
keeps two offsets: the unread tokens are decoded together with the tokens of the previous delta (so
that tokenizers which merge spaces or bytes across tokens see their left context), and only the new
part is emitted. A delta ending in U+FFFD is held back: it is a multi-byte character split across
tokens, and the next token completes it.

It runs in its own process so that decoding text never slows the scheduler's step loop. Per request
it keeps an IncrementalDetokenizer and applies the stop-string rules:
- while streaming, text that could be the start of a stop string is held back, so a client never
  sees part of a stop string;
- at the end, the text is cut where the stop string begins (unless no_stop_trim is set).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from radixserve.config.log import configure_logging
from radixserve.models.text_decoder import load_decoder
from radixserve.protocol.ipc import ChildArgs, child_channels, exit_after_clean_stop, parse_child_args
from radixserve.protocol.messages import (
    ControlResult,
    DetokenizeParams,
    OutputBatch,
    ReqOutput,
    SchedulerFailed,
    SchedulerReady,
    ShutdownRequest,
    TextBatch,
    TextOutput,
)

logger = logging.getLogger("radixserve.detokenizer")


REPLACEMENT_CHAR = "\ufffd"
# How often the detokenizer looks for the tokenizer the engine is writing at startup.
TOKENIZER_POLL_S = 0.02


@dataclass
class IncrementalDetokenizer:
    tokenizer: Any
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""

    def push(self, new_ids: list[int], final: bool = False) -> str:
        """Adds tokens; returns the text that became complete (everything left, when final)."""
        self.ids.extend(new_ids)
        options = {
            "skip_special_tokens": self.skip_special_tokens,
            "spaces_between_special_tokens": self.spaces_between_special_tokens,
        }
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self.prefix_offset : self.read_offset], **options)
        full_text = decode(self.ids[self.prefix_offset :], **options)
        if len(full_text) <= len(prefix_text) or (full_text.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        delta: str = full_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta


def held_back_length(text: str, stops: list[str]) -> int:
    """How many trailing characters of text could be the beginning of a stop string."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


@dataclass
class RequestText:
    """One request's decoding state."""

    detokenizer: IncrementalDetokenizer
    params: DetokenizeParams
    emitted: int = 0  # characters of detokenizer.text already sent
    ids: list[int] = field(default_factory=list)

    def push(self, out: ReqOutput) -> str:
        finish = out.finished_reason
        new_ids = out.new_token_ids
        trim_token = (
            finish is not None
            and isinstance(finish.matched, int)
            and not self.params.no_stop_trim
            and new_ids
            and new_ids[-1] == finish.matched
        )
        # A matched stop token is not part of the text (EOS usually is skipped anyway as special).
        self.detokenizer.push(new_ids[:-1] if trim_token else new_ids, final=finish is not None)
        text = self.detokenizer.text
        end = len(text)
        stops = self.params.stop
        if finish is not None:
            if isinstance(finish.matched, str) and not self.params.no_stop_trim:
                # Nothing of the stop string was emitted (it was held back), so it starts here or later.
                cut = text.find(finish.matched, self.emitted)
                if cut >= 0:
                    end = cut
        elif stops:
            # The scheduler finishes a request on the token that completes a stop string, so a whole
            # one shows up here only if text and token views disagree; never emit it either way.
            found = [i for stop in stops if (i := text.find(stop, self.emitted)) >= 0]
            end = min(found) if found else end - held_back_length(text, stops)
        end = max(end, self.emitted)
        delta = text[self.emitted : end]
        self.emitted = end
        return delta


class DetokenizerManager:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestText] = {}

    def handle(self, batch: OutputBatch) -> TextBatch:
        texts = []
        for out in batch.outputs:
            state = self.requests.get(out.rid)
            if state is None:
                params = out.detokenize
                state = RequestText(
                    IncrementalDetokenizer(
                        self.tokenizer, params.skip_special_tokens, params.spaces_between_special_tokens
                    ),
                    params,
                )
                self.requests[out.rid] = state
            delta = state.push(out)
            if out.finished_reason is not None:
                del self.requests[out.rid]
            texts.append(
                TextOutput(
                    out.rid,
                    delta,
                    out.new_token_ids,
                    out.finished_reason,
                    out.prompt_tokens,
                    out.completion_tokens,
                    out.cached_tokens,
                    out.logprobs,
                    out.input_logprobs,
                    out.embedding,
                    out.hidden_states,
                    out.prompt_hidden_states,
                    out.received_at,
                    out.received_idle,
                    out.first_output_at,
                )
            )
        return TextBatch(texts)


def run_detokenizer_process(child: ChildArgs) -> None:
    # The scheduler connects to our inbox; the engine bound the socket we send to.
    with child_channels("detokenizer", child.inbox, child.outbox, bind_inbox=True) as (inbox, outbox):
        assert inbox is not None
        # The engine writes the tokenizer while the children start (runtime/launch.py); the inbox is
        # bound meanwhile, so what a scheduler sends waits here.
        while not os.path.isdir(child.tokenizer_dir):
            if os.getppid() != child.parent_pid:
                logger.warning("parent process is gone; detokenizer exiting")
                return
            time.sleep(TOKENIZER_POLL_S)
        manager = DetokenizerManager(load_decoder(child.tokenizer_dir))
        stopped = 0
        while True:
            msg = inbox.recv(child.idle_wait_ms)
            if msg is None:
                if os.getppid() != child.parent_pid:
                    logger.warning("parent process is gone; detokenizer exiting")
                    return
                continue
            if isinstance(msg, OutputBatch):
                outbox.send(manager.handle(msg))
            elif isinstance(msg, (ControlResult, SchedulerFailed, SchedulerReady)):
                outbox.send(msg)
            elif isinstance(msg, ShutdownRequest):
                # Every scheduler replica says goodbye; the engine hears once, after the last.
                stopped += 1
                if stopped == child.ns.num_schedulers:
                    outbox.send(msg)
                    return
            else:
                raise TypeError(f"unexpected detokenizer message {type(msg).__name__}")


def main() -> None:
    child = parse_child_args(
        "radixserve detokenizer process (started by the engine)",
        lambda parser: (
            parser.add_argument("--log-level", default="info"),
            parser.add_argument("--num-schedulers", type=int, default=1),
        ),
    )
    configure_logging(child.ns.log_level, prefix=" detokenizer")
    run_detokenizer_process(child)
    exit_after_clean_stop()


if __name__ == "__main__":
    main()
