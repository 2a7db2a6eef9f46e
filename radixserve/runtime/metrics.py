"""Prometheus metrics (`--enable-metrics` → GET /metrics), SGLang's names under the radixserve prefix.

Request latencies and token counters are observed on the request side as outputs arrive (the
engine's reader thread); scheduler gauges (queue, running, KV usage, cache hit rate, throughput)
are read from the scheduler when /metrics is scraped. Each engine has its own registry.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Latency buckets (seconds) fit for CPUs as well as GPUs.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

# Scheduler stats exported as gauges: metric name → get_stats key.
SCHEDULER_GAUGES = {
    "num_running_reqs": "num_running_reqs",
    "num_queue_reqs": "num_waiting_reqs",
    "num_grammar_queue_reqs": "num_grammar_queue_reqs",
    "token_usage": "token_usage",
    "cache_hit_rate": "cache_hit_rate",
    "gen_throughput": "gen_throughput",
    "num_retracted_reqs": "retracted_reqs",
    "spec_accept_length": "avg_spec_accept_length",
    "spec_accept_rate": "spec_accept_rate",
    # --enable-hierarchical-cache with a storage tier (cache/storage_tier.py); 0 without one.
    "hicache_storage_hit_tokens": "hicache_storage_hit_tokens",
    "hicache_storage_loads": "hicache_storage_loads",
    "hicache_storage_load_failures": "hicache_storage_load_failures",
    "hicache_storage_pages_written": "hicache_storage_pages_written",
    "hicache_storage_writes_dropped": "hicache_storage_writes_dropped",
    "hicache_storage_bytes_read": "hicache_storage_bytes_read",
    "hicache_storage_bytes_written": "hicache_storage_bytes_written",
    "hicache_storage_load_seconds": "hicache_storage_load_seconds",
    "hicache_storage_write_seconds": "hicache_storage_write_seconds",
    "hicache_storage_queued_writes": "hicache_storage_queued_writes",
    "hicache_storage_loads_in_flight": "hicache_storage_loads_in_flight",
    "hicache_storage_bytes": "hicache_storage_bytes",
    # L2, the host-memory pool beside a CUDA device pool (cache/host_storage.py); 0 without one.
    "hicache_host_pages": "hicache_host_pages",
    "hicache_host_bytes": "hicache_host_bytes",
    "hicache_host_pages_loaded": "hicache_host_pages_loaded",
}


@dataclass
class RequestClock:
    """When a request was submitted and last produced output."""

    submitted: float
    last_output: float | None = None


class EngineMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        self._labels = labels

        def counter(name: str, doc: str) -> Any:
            return Counter(f"radixserve:{name}", doc, list(labels), registry=self.registry).labels(**labels)

        def histogram(name: str, doc: str) -> Any:
            return Histogram(
                f"radixserve:{name}", doc, list(labels), buckets=LATENCY_BUCKETS, registry=self.registry
            ).labels(**labels)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("generation_tokens", "Generated tokens of finished requests")
        self.cached_tokens = counter("cached_tokens", "Prompt tokens served from the radix cache")
        self.requests = counter("num_requests", "Finished requests")
        self.aborted = counter("num_aborted_requests", "Requests that finished by abort")
        self.ttft = histogram("time_to_first_token_seconds", "Time to the first output")
        self.itl = histogram("inter_token_latency_seconds", "Time between outputs, per token")
        self.e2e = histogram("e2e_request_latency_seconds", "Time from submission to the last output")
        self._gauges = {
            name: Gauge(
                f"radixserve:{name}", f"Scheduler {key}", list(labels), registry=self.registry
            ).labels(**labels)
            for name, key in SCHEDULER_GAUGES.items()
        }
        self._clocks: dict[str, RequestClock] = {}

    def submitted(self, rid: str) -> None:
        self._clocks[rid] = RequestClock(time.monotonic())

    def output(
        self, rid: str, new_tokens: int, finished: bool, usage: tuple[int, int, int], aborted: bool
    ) -> None:
        """Called for every output: usage is (prompt, completion, cached) tokens."""
        clock = self._clocks.get(rid)
        if clock is None:
            return
        now = time.monotonic()
        if new_tokens:
            if clock.last_output is None:
                self.ttft.observe(now - clock.submitted)
            else:
                gap = (now - clock.last_output) / new_tokens
                for _ in range(new_tokens):
                    self.itl.observe(gap)
            clock.last_output = now
        if finished:
            del self._clocks[rid]
            prompt, completion, cached = usage
            self.e2e.observe(now - clock.submitted)
            self.requests.inc()
            self.prompt_tokens.inc(prompt)
            self.generation_tokens.inc(completion)
            self.cached_tokens.inc(cached)
            if aborted:
                self.aborted.inc()

    def forget(self, rid: str) -> None:
        self._clocks.pop(rid, None)

    def render(self, scheduler_stats: dict[str, Any]) -> bytes:
        for name, key in SCHEDULER_GAUGES.items():
            self._gauges[name].set(float(scheduler_stats.get(key, 0.0)))
        return generate_latest(self.registry)
