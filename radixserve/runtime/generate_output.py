"""GenerateOutput: one request's state as its outputs arrive, and the native API's result shape."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from radixserve.protocol.messages import FinishReason, TextOutput, TokenLogprobs


@dataclass
class GenerateOutput:
    """One request's state after an output: everything so far, and what is new."""

    rid: str
    text: str = ""
    delta: str = ""
    output_ids: list[int] = field(default_factory=list)
    new_token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    e2e_latency: float = 0.0
    # Set when logprobs were asked for: all output tokens', and the newest output's.
    logprobs: TokenLogprobs | None = None
    new_logprobs: TokenLogprobs | None = None
    # Prompt logprobs (from logprob_start_len on, token 0 excluded), when asked for.
    prompt_ids: list[int] = field(default_factory=list)
    logprob_start_len: int = -1
    input_logprobs: TokenLogprobs | None = None
    token_ids_logprob: list[int] | None = None
    embedding: list[float] | None = None
    hidden_states: list[list[float]] | None = None
    prompt_hidden_states: list[list[float]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, out: TextOutput, started: float) -> None:
        self.delta = out.text_delta
        self.text += out.text_delta
        self.new_token_ids = out.new_token_ids
        self.output_ids = self.output_ids + out.new_token_ids
        self.finish_reason = out.finished_reason
        self.prompt_tokens = out.prompt_tokens
        self.completion_tokens = out.completion_tokens
        self.cached_tokens = out.cached_tokens
        self.e2e_latency = time.perf_counter() - started
        self.new_logprobs = out.logprobs
        if out.input_logprobs is not None:
            self.input_logprobs = out.input_logprobs
        if out.embedding is not None:
            self.embedding = out.embedding
        if out.hidden_states is not None:
            self.hidden_states = (self.hidden_states or []) + out.hidden_states
        if out.prompt_hidden_states is not None:
            self.prompt_hidden_states = out.prompt_hidden_states
        if out.logprobs is not None:
            # A fresh object: stream snapshots share the old one.
            merged = TokenLogprobs() if self.logprobs is None else self.logprobs.copy()
            merged.extend(out.logprobs)
            self.logprobs = merged

    def meta_info(self) -> dict[str, Any]:
        finish = self.finish_reason
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": finish.to_dict() if finish else None,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "e2e_latency": self.e2e_latency,
        }
        if self.logprobs is not None:
            # SGLang's shape: (logprob, token id, text) triples; text stays None here.
            lp = self.logprobs
            meta["output_token_logprobs"] = [
                [value, token, None] for value, token in zip(lp.logprobs, self.output_ids, strict=False)
            ]
            meta["output_top_logprobs"] = [
                [[value, token, None] for value, token in zip(values, ids, strict=True)]
                for values, ids in zip(lp.top_logprobs, lp.top_ids, strict=True)
            ]
            if self.token_ids_logprob:
                meta["output_token_ids_logprobs"] = self._named_triples(lp)
        if self.hidden_states is not None:
            # SGLang's shape: first every prompt position's state (a list of vectors), then one
            # vector per output token after the first (the state of its position in the sequence).
            prompt = (self.prompt_hidden_states or []) + self.hidden_states[:1]
            meta["hidden_states"] = [prompt, *self.hidden_states[1:]]
        if self.input_logprobs is not None:
            meta["input_token_logprobs"], meta["input_top_logprobs"] = self.prompt_logprob_triples()
            if self.token_ids_logprob:
                named = self._named_triples(self.input_logprobs)
                meta["input_token_ids_logprobs"] = ([None] if self.logprob_start_len == 0 else []) + named
        return meta

    def _named_triples(self, lp: TokenLogprobs) -> list[list[list[Any]]]:
        """Per position, (logprob, token id, text) for each id of token_ids_logprob."""
        ids = self.token_ids_logprob or []
        return [[[v, t, None] for v, t in zip(values, ids, strict=True)] for values in lp.id_logprobs]

    def prompt_logprob_triples(self) -> tuple[list[list[Any]], list[list[list[Any]] | None]]:
        """SGLang's input_token_logprobs and input_top_logprobs, from logprob_start_len on; the
        first prompt token has no logprob (nothing predicts it), shown as None."""
        assert self.input_logprobs is not None
        lp, start = self.input_logprobs, self.logprob_start_len
        first = max(start, 1)
        tokens: list[list[Any]] = [[None, self.prompt_ids[0], None]] if start == 0 else []
        tops: list[list[list[Any]] | None] = [None] if start == 0 else []
        tokens += [[v, t, None] for v, t in zip(lp.logprobs, self.prompt_ids[first:], strict=True)]
        tops += [
            [[v, t, None] for v, t in zip(values, ids, strict=True)]
            for values, ids in zip(lp.top_logprobs, lp.top_ids, strict=True)
        ]
        return tokens, tops

    def to_dict(self) -> dict[str, Any]:
        """The native API's result: text, output_ids and meta_info (an embedding request's:
        embedding and meta_info)."""
        if self.embedding is not None:
            meta = {"id": self.rid, "prompt_tokens": self.prompt_tokens, "e2e_latency": self.e2e_latency}
            return {"embedding": self.embedding, "meta_info": meta}
        return {"text": self.text, "output_ids": self.output_ids, "meta_info": self.meta_info()}
