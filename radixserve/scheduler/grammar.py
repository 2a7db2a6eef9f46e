"""Grammar-constrained decoding: compiled grammars (xgrammar), their cache, and per-request matchers.

Compiling a grammar can take from microseconds to seconds (large JSON schemas). It runs in a thread
pool; the request waits in the scheduler's grammar queue (grammar_queue.py) meanwhile, and every other
request keeps running. Compiled grammars are cached by (kind, spec), failures too, so a bad schema sent
again fails at once. On each step the matcher of every constrained request writes its allowed-token
bitmask; the sampler masks everything else; the accepted token advances the matcher.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.protocol.sampling_params import ANY_JSON, SamplingParams

# The grammar kinds a request may carry, by their SamplingParams field.
GRAMMAR_KINDS = ("json_schema", "regex", "ebnf", "structural_tag")


class InvalidGrammarError(ValueError):
    """The grammar could not be compiled; the message says why."""


def structural_tag_spec(spec: str) -> str:
    """xgrammar's structural tag JSON ({"type": "structural_tag", "format": ...}). SGLang's older
    form, {"structures": [{"begin", "schema", "end"}], "triggers": [...]}, is translated into it:
    free text until a trigger, then one of the tags, each wrapping JSON under its schema."""
    tag = json.loads(spec)
    if not isinstance(tag, dict) or "structures" not in tag:
        return spec
    tags = [
        {
            "type": "tag",
            "begin": item["begin"],
            "content": {"type": "json_schema", "json_schema": item.get("schema", {})},
            "end": item["end"],
        }
        for item in tag["structures"]
    ]
    triggers = tag.get("triggers") or [item["begin"] for item in tag["structures"]]
    return json.dumps(
        {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": triggers, "tags": tags}}
    )


def grammar_key(params: SamplingParams) -> tuple[str, str] | None:
    """(kind, spec) of the request's grammar, or None when it is unconstrained."""
    for kind in GRAMMAR_KINDS:
        spec = getattr(params, kind)
        if spec is not None:
            return kind, spec
    return None


@dataclass
class CompileResult:
    grammar: Any | None = None  # xgrammar.CompiledGrammar
    error: str | None = None


class GrammarBackend:
    """xgrammar compiler + thread pool + cache. Thread-safe for the scheduler's use."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_workers: int = 1):
        import xgrammar as xgr

        self._xgr = xgr
        self._tokenizer = tokenizer
        self._control_tokens: torch.Tensor | None = None
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_workers)
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="radixserve-grammar")
        self._batch_matcher = xgr.BatchGrammarMatcher(max_threads=max(1, torch.get_num_threads()))
        self._cache: dict[tuple[str, str], Future[CompileResult]] = {}
        self._lock = threading.Lock()

    def compile(self, key: tuple[str, str]) -> Future[CompileResult]:
        """The compiled grammar for key, from the cache or from a new compile job."""
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                future = self._pool.submit(self._compile_safely, key)
                self._cache[key] = future
            return future

    def _compile_safely(self, key: tuple[str, str]) -> CompileResult:
        try:
            return CompileResult(grammar=self._compile(*key))
        except Exception as exc:  # every compile failure is the request's fault: report it
            return CompileResult(error=f"invalid {key[0]}: {str(exc).splitlines()[-1][:500]}")

    def _compile(self, kind: str, spec: str) -> Any:
        compiler = self._compiler
        if kind == "json_schema":
            if spec == ANY_JSON:
                return compiler.compile_builtin_json_grammar()
            json.loads(spec)  # a clear error for text that is not JSON at all
            # Compact JSON: with free whitespace a model can emit blanks forever.
            return compiler.compile_json_schema(spec, any_whitespace=False)
        if kind == "regex":
            return compiler.compile_regex(spec)
        if kind == "ebnf":
            return compiler.compile_grammar(spec)
        if kind == "structural_tag":
            return compiler.compile_structural_tag(structural_tag_spec(spec))
        raise InvalidGrammarError(f"unknown grammar kind {kind!r}")

    def matcher(self, compiled: Any, kind: str) -> GrammarMatcher:
        return GrammarMatcher(self._xgr.GrammarMatcher(compiled), is_json=kind == "json_schema")

    @property
    def control_tokens(self) -> torch.Tensor:
        """[vocab] bool: tokens whose text holds a control character (U+0000-U+001F). xgrammar's
        JSON strings admit them raw, which strict JSON parsers reject; JSON rows mask them out
        (whitespace is not needed: JSON is generated compact)."""
        if self._control_tokens is None:
            decode = self._tokenizer.decode
            flags = [
                any(ord(ch) < 0x20 for ch in decode([token])) if token < len(self._tokenizer) else False
                for token in range(self.vocab_size)
            ]
            self._control_tokens = torch.tensor(flags, dtype=torch.bool)
        return self._control_tokens

    def bitmask(self, matchers: list[GrammarMatcher | None], device: torch.device) -> torch.Tensor:
        """[B, vocab] bool: the tokens each row may take (all, for rows without a grammar)."""
        packed = self._xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        present = [(row, m) for row, m in enumerate(matchers) if m is not None]
        rows = [row for row, _ in present]
        # One call for the batch; xgrammar fills the rows on its own threads.
        self._batch_matcher.batch_fill_next_token_bitmask([m.matcher for _, m in present], packed, rows)
        # Unpack 32 tokens per int32 word, lowest bit first.
        bits = (packed.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        allowed = bits.reshape(len(matchers), -1)[:, : self.vocab_size].bool()
        json_rows = torch.tensor([row for row, m in present if m.is_json], dtype=torch.int64)
        if len(json_rows):
            strict = allowed[json_rows] & ~self.control_tokens
            keep = strict.any(1)  # never leave a row with nothing to pick
            allowed[json_rows[keep]] = strict[keep]
        return allowed.to(device)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class GrammarMatcher:
    """One request's position in its grammar."""

    matcher: Any  # xgrammar.GrammarMatcher
    is_json: bool = False

    def accept(self, token: int) -> bool:
        return bool(self.matcher.accept_token(token))

    @property
    def terminated(self) -> bool:
        return bool(self.matcher.is_terminated())
