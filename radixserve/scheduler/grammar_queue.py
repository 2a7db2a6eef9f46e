"""The grammar queue: requests whose grammar (grammar.py) is still compiling.

A request with a grammar waits here instead of in the scheduler's waiting queue until its compile job
ends, so that a slow compile never holds up other requests. The scheduler polls the queue every step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures
from typing import Any

from radixserve.scheduler.grammar import GrammarBackend, InvalidGrammarError
from radixserve.scheduler.request import Req


class GrammarQueue:
    """Requests whose grammar is still compiling. The scheduler polls it every step."""

    def __init__(
        self,
        backend_name: str,
        timeout_s: float,
        tokenizer: Callable[[], Any],
        vocab_size: int,
        agree: Callable[[list[int]], list[int]] = lambda settled: settled,
    ):
        """`agree` makes tensor-parallel ranks settle the same requests in the same step (rank 0's
        view wins: scheduler/rank_sync.py); alone, a scheduler trusts its own clock."""
        self.agree = agree
        self.backend_name = backend_name
        self.timeout_s = timeout_s
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._backend: GrammarBackend | None = None
        self.pending: list[Req] = []

    @property
    def backend(self) -> GrammarBackend:
        # Built on first use: most servers never see a grammar, and xgrammar takes a while to set up.
        if self._backend is None:
            self._backend = GrammarBackend(self._tokenizer(), self._vocab_size)
        return self._backend

    def add(self, req: Req, key: tuple[str, str]) -> None:
        """Starts (or finds) the compile job of req's grammar and queues req until it is done."""
        if self.backend_name == "none":
            raise InvalidGrammarError(
                f"{key[0]} needs a grammar backend; the server runs with --grammar-backend none"
            )
        req.grammar_key = key
        req.grammar_job = self.backend.compile(key)
        req.grammar_deadline = time.monotonic() + self.timeout_s
        self.pending.append(req)

    def poll(self) -> tuple[list[Req], list[tuple[Req, str]]]:
        """(requests whose grammar is ready, now with a matcher; requests that failed, with why)."""
        ready: list[Req] = []
        failed: list[tuple[Req, str]] = []
        now = time.monotonic()
        # Settled requests as 2 * index, plus one when the deadline passed before the compile ended.
        settled = []
        for index, req in enumerate(self.pending):
            assert req.grammar_job is not None
            if req.grammar_job.done():
                settled.append(2 * index)
            elif now > req.grammar_deadline:
                settled.append(2 * index + 1)
        settled = self.agree(settled)
        for code in settled:
            req, timed_out = self.pending[code // 2], code % 2 == 1
            job = req.grammar_job
            assert job is not None
            if not timed_out:
                # Done here, or on rank 0 and soon here too: the same compile on the same inputs.
                result = job.result()
                if result.error is not None:
                    failed.append((req, result.error))
                else:
                    assert req.grammar_key is not None
                    req.grammar = self.backend.matcher(result.grammar, req.grammar_key[0])
                    ready.append(req)
            else:
                failed.append(
                    (req, f"the grammar did not compile within {self.timeout_s:g}s (--grammar-timeout)")
                )
            req.grammar_job = None
        gone = {code // 2 for code in settled}
        self.pending = [req for index, req in enumerate(self.pending) if index not in gone]
        return ready, failed

    def wait(self, timeout_s: float) -> None:
        """Blocks up to timeout_s for any pending compile to finish (when nothing else can run)."""
        jobs = [r.grammar_job for r in self.pending if r.grammar_job is not None]
        if jobs:
            wait_futures(jobs, timeout=timeout_s, return_when=FIRST_COMPLETED)

    def remove(self, req: Req) -> bool:
        if req in self.pending:
            self.pending.remove(req)
            return True
        return False

    def shutdown(self) -> None:
        if self._backend is not None:
            self._backend.shutdown()
