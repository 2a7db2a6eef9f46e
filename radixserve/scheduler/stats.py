"""Counters the scheduler keeps, and the prefill/decode log lines it prints (SGLang's format)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

logger = logging.getLogger("radixserve.scheduler")

# A gap between two forwards longer than this was the scheduler waiting for requests, not working.
IDLE_GAP_S = 0.01


@dataclass
class HostTimeLine:
    """The scheduler's own time before each decode step that follows another forward back to back
    (sampling and publishing the last step's tokens, taking new requests, building the batch), as
    a straight line in the step's rows, fitted by least squares. The simulator prices a decode
    step as this host time plus the model's forward, and one model's timed runs cannot split the
    two: both grow with the rows. So calibrate reads this line off the engine it times and holds
    the profile's cost per row at its slope (simulator/calibrate.py)."""

    steps: int = 0
    _rows: float = 0.0
    _seconds: float = 0.0
    _rows_squared: float = 0.0
    _rows_seconds: float = 0.0
    _last_end: float | None = None

    def add(self, rows: int, seconds: float) -> None:
        self.steps += 1
        self._rows += rows
        self._seconds += seconds
        self._rows_squared += rows * rows
        self._rows_seconds += rows * seconds

    def forward_started(self, now: float, decode_rows: int | None) -> None:
        """A forward starts at `now` (time.perf_counter); decode_rows: a plain decode step's rows,
        None for any other forward (a prefill's host time depends on its prompts, not its rows)."""
        if decode_rows is not None and self._last_end is not None and now - self._last_end < IDLE_GAP_S:
            self.add(decode_rows, now - self._last_end)

    def forward_ended(self, now: float) -> None:
        self._last_end = now

    def line(self) -> tuple[float, float] | None:
        """(seconds per step, seconds per row); None before two batch sizes have been seen."""
        spread = self.steps * self._rows_squared - self._rows**2
        if self.steps < 2 or spread <= 1e-9 * max(1.0, self._rows_squared):
            return None
        per_row = (self.steps * self._rows_seconds - self._rows * self._seconds) / spread
        return (self._seconds - per_row * self._rows) / self.steps, per_row

    def describe(self) -> dict[str, float | int | None]:
        fitted = self.line()
        fixed, per_row = (None, None) if fitted is None else fitted
        return {"steps": self.steps, "fixed_s": fixed, "per_row_s": per_row}


@dataclass
class SchedulerStats:
    forward_steps: int = 0
    prefill_batches: int = 0
    decode_steps: int = 0
    retracted_reqs: int = 0
    # Steps whose previous results were published while their forward ran (overlap schedule).
    overlapped_steps: int = 0
    # Seconds inside step() and, of those, inside the model's forward (with the publish it
    # overlaps): the difference is the scheduler's own time.
    step_time_s: float = 0.0
    forward_time_s: float = 0.0
    aborted_reqs: int = 0
    prompt_tokens_computed: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    # Over the last decode-log window: output tokens per second, seconds per decode step (the
    # inter-token latency of a running request), and the mean time to first token of the requests
    # that got theirs, from arrival at the scheduler.
    gen_throughput: float = 0.0
    inter_token_latency: float = 0.0
    time_to_first_token: float = 0.0
    # Speculative decoding: verify steps taken per request (each emits one token or more), the
    # draft tokens proposed and accepted in them, and the tokens they emitted.
    spec_verify_reqs: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_emitted_tokens: int = 0
    decode_host_time: HostTimeLine = field(default_factory=HostTimeLine)
    _window_start: float = field(default_factory=time.perf_counter)
    _window_tokens: int = 0
    _window_steps: int = 0
    _window_ttfts: list[float] = field(default_factory=list)

    def log_prefill(
        self, new_seq: int, new_tokens: int, cached: int, usage: float, running: int, queued: int
    ) -> None:
        self.prefill_batches += 1
        self.prompt_tokens_computed += new_tokens
        self.cached_tokens += cached
        logger.info(
            "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, cache hit rate: %.2f, "
            "token usage: %.2f, #running-req: %d, #queue-req: %d",
            new_seq,
            new_tokens,
            cached,
            self.cache_hit_rate,
            usage,
            running,
            queued,
        )

    def record_decode(self, batch_size: int) -> None:
        self.decode_steps += 1
        self._window_steps += 1
        self._window_tokens += batch_size

    def record_extra_tokens(self, count: int) -> None:
        """Tokens a decode step emitted beyond one per request (accepted speculative drafts)."""
        self._window_tokens += count

    def record_verify(self, drafted: int, accepted: int, emitted: int) -> None:
        self.spec_verify_reqs += 1
        self.spec_draft_tokens += drafted
        self.spec_accepted_tokens += accepted
        self.spec_emitted_tokens += emitted

    @property
    def spec_accept_length(self) -> float:
        """Tokens emitted per request per verify step (1.0: no draft ever accepted)."""
        return self.spec_emitted_tokens / self.spec_verify_reqs if self.spec_verify_reqs else 0.0

    @property
    def spec_accept_rate(self) -> float:
        """The fraction of proposed draft tokens that were accepted."""
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    def record_first_token(self, seconds: float) -> None:
        self._window_ttfts.append(seconds)

    @property
    def cache_hit_rate(self) -> float:
        """The fraction of prefilled prompt tokens that came from the radix cache."""
        total = self.cached_tokens + self.prompt_tokens_computed
        return self.cached_tokens / total if total else 0.0

    def log_decode(self, running: int, used_tokens: int, usage: float, queued: int) -> None:
        now = time.perf_counter()
        elapsed = max(now - self._window_start, 1e-9)
        self.gen_throughput = self._window_tokens / elapsed
        self.inter_token_latency = elapsed / max(self._window_steps, 1)
        if self._window_ttfts:
            self.time_to_first_token = sum(self._window_ttfts) / len(self._window_ttfts)
        self._window_start, self._window_tokens, self._window_steps = now, 0, 0
        self._window_ttfts = []
        speculative = ""
        if self.spec_verify_reqs:
            speculative = (
                f"accept len: {self.spec_accept_length:.2f}, accept rate: {self.spec_accept_rate:.2f}, "
            )
        logger.info(
            "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, %s"
            "gen throughput (token/s): %.2f, ITL (ms): %.1f, TTFT (ms): %.1f, #queue-req: %d",
            running,
            used_tokens,
            usage,
            speculative,
            self.gen_throughput,
            1000 * self.inter_token_latency,
            1000 * self.time_to_first_token,
            queued,
        )
