"""The request side of the dashboard (--enable-dashboard): throughput over the last seconds,
TTFT / ITL / E2E percentiles over the last minute, and the most recent requests with their timings,
observed as outputs arrive (the engine's reader thread), like the Prometheus metrics."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

LATENCY_WINDOW_S = 60.0
THROUGHPUT_WINDOW_S = 5.0
RECENT_REQUESTS = 50


@dataclass
class _Request:
    rid: str
    submitted: float
    prompt_tokens: int
    output_tokens: int = 0
    cached_tokens: int = 0
    first_output: float | None = None
    last_output: float | None = None
    finished: float | None = None
    finish_reason: str | None = None


def percentiles(values: list[float]) -> dict[str, Any]:
    """count, p50, p90, p99 (nearest rank) of values; None where there are none."""
    if not values:
        return {"count": 0, "p50": None, "p90": None, "p99": None}
    ordered = sorted(values)

    def rank(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"count": len(ordered), "p50": rank(0.5), "p90": rank(0.9), "p99": rank(0.99)}


class LiveStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.started = time.monotonic()
        self._requests: OrderedDict[str, _Request] = OrderedDict()
        # (time, value ms) samples within LATENCY_WINDOW_S, and (time, prompt, output) token counts
        # within THROUGHPUT_WINDOW_S.
        self._ttft: deque[tuple[float, float]] = deque()
        self._itl: deque[tuple[float, float]] = deque()
        self._e2e: deque[tuple[float, float]] = deque()
        self._tokens: deque[tuple[float, int, int]] = deque()
        self.totals = {
            "requests": 0,
            "prompt_tokens": 0,
            "output_tokens": 0,
            "cached_tokens": 0,
            "aborted": 0,
        }

    def submitted(self, rid: str, prompt_tokens: int) -> None:
        with self._lock:
            self._requests[rid] = _Request(rid, time.monotonic(), prompt_tokens)
            self.totals["requests"] += 1
            # Finished requests beyond the recent ones are forgotten; running ones are kept.
            while len(self._requests) > RECENT_REQUESTS:
                done = next((r.rid for r in self._requests.values() if r.finished is not None), None)
                if done is None:
                    break
                del self._requests[done]

    def output(self, rid: str, new_tokens: int, cached_tokens: int, finish_reason: str | None) -> None:
        now = time.monotonic()
        with self._lock:
            req = self._requests.get(rid)
            if req is None:
                return
            if new_tokens:
                if req.first_output is None:
                    req.first_output = now
                    self._ttft.append((now, (now - req.submitted) * 1000))
                    self._tokens.append((now, req.prompt_tokens, new_tokens))
                    self.totals["prompt_tokens"] += req.prompt_tokens
                else:
                    assert req.last_output is not None
                    # A chunk of several tokens spreads its wait over them (stream_interval > 1).
                    gap = (now - req.last_output) * 1000 / new_tokens
                    self._itl.extend((now, gap) for _ in range(new_tokens))
                    self._tokens.append((now, 0, new_tokens))
                req.last_output = now
                req.output_tokens += new_tokens
                self.totals["output_tokens"] += new_tokens
            req.cached_tokens = cached_tokens
            if finish_reason is not None:
                req.finished, req.finish_reason = now, finish_reason
                self.totals["cached_tokens"] += cached_tokens
                self.totals["aborted"] += finish_reason == "abort"
                self._e2e.append((now, (now - req.submitted) * 1000))

    def snapshot(self) -> dict[str, Any]:
        now = time.monotonic()
        with self._lock:
            for samples, window in (
                (self._ttft, LATENCY_WINDOW_S),
                (self._itl, LATENCY_WINDOW_S),
                (self._e2e, LATENCY_WINDOW_S),
                (self._tokens, THROUGHPUT_WINDOW_S),
            ):
                while samples and samples[0][0] < now - window:
                    samples.popleft()
            prompt = sum(p for _, p, _ in self._tokens)
            output = sum(o for _, _, o in self._tokens)
            firsts = sum(1 for _, p, _ in self._tokens if p)
            recent = [self._describe(r, now) for r in reversed(self._requests.values())]
            return {
                "uptime_s": now - self.started,
                "throughput": {
                    "prompt_tok_s": prompt / THROUGHPUT_WINDOW_S,
                    "output_tok_s": output / THROUGHPUT_WINDOW_S,
                    "requests_s": firsts / THROUGHPUT_WINDOW_S,
                },
                "latency": {
                    "window_s": LATENCY_WINDOW_S,
                    "ttft_ms": percentiles([v for _, v in self._ttft]),
                    "itl_ms": percentiles([v for _, v in self._itl]),
                    "e2e_ms": percentiles([v for _, v in self._e2e]),
                },
                "totals": dict(self.totals),
                "recent": recent[:RECENT_REQUESTS],
            }

    @staticmethod
    def _describe(req: _Request, now: float) -> dict[str, Any]:
        state = (
            "running" if req.finished is None else "aborted" if req.finish_reason == "abort" else "finished"
        )
        ttft = None if req.first_output is None else (req.first_output - req.submitted) * 1000
        return {
            "rid": req.rid,
            "state": state,
            "prompt_tokens": req.prompt_tokens,
            "output_tokens": req.output_tokens,
            "cached_tokens": req.cached_tokens,
            "ttft_ms": ttft,
            "e2e_ms": None if req.finished is None else (req.finished - req.submitted) * 1000,
            "finish_reason": req.finish_reason,
            "age_s": now - req.submitted,
        }
