"""Counters the scheduler keeps, and the prefill/decode log lines it prints (SGLang's format)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

logger = logging.getLogger("radixserve.scheduler")


@dataclass
class SchedulerStats:
    forward_steps: int = 0
    prefill_batches: int = 0
    decode_steps: int = 0
    retracted_reqs: int = 0
    aborted_reqs: int = 0
    prompt_tokens_computed: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    # Throughput window for the decode log line.
    # Output tokens per second over the last decode-log window.
    gen_throughput: float = 0.0
    _window_start: float = field(default_factory=time.perf_counter)
    _window_tokens: int = 0

    def log_prefill(
        self, new_seq: int, new_tokens: int, cached: int, usage: float, running: int, queued: int
    ) -> None:
        self.prefill_batches += 1
        self.prompt_tokens_computed += new_tokens
        self.cached_tokens += cached
        logger.info(
            "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
            "#running-req: %d, #queue-req: %d",
            new_seq,
            new_tokens,
            cached,
            usage,
            running,
            queued,
        )

    def record_decode(self, batch_size: int) -> None:
        self.decode_steps += 1
        self._window_tokens += batch_size

    @property
    def cache_hit_rate(self) -> float:
        """The fraction of prefilled prompt tokens that came from the radix cache."""
        total = self.cached_tokens + self.prompt_tokens_computed
        return self.cached_tokens / total if total else 0.0

    def log_decode(self, running: int, used_tokens: int, usage: float, queued: int) -> None:
        now = time.perf_counter()
        throughput = self._window_tokens / max(now - self._window_start, 1e-9)
        self._window_start, self._window_tokens = now, 0
        self.gen_throughput = throughput
        logger.info(
            "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, gen throughput (token/s): %.2f, "
            "#queue-req: %d",
            running,
            used_tokens,
            usage,
            throughput,
            queued,
        )
