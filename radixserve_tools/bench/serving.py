"""`radixserve bench serving`: load-test any OpenAI-compatible server over HTTP.

Requests stream from /v1/completions (or /v1/chat/completions); per request the client records the
time to the first content chunk (TTFT), the gaps between content chunks (ITL), the end-to-end
latency and the server's usage counts, then aggregates them into throughput and latency
percentiles. Arrivals are all at once or a Poisson process, optionally capped by a concurrency
limit. Nothing here knows about radixserve internals: the server is a URL.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from radixserve_tools.bench.serving_datasets import (
    DATASET_NAMES,
    BenchRequest,
    load_tokenizer,
    sample_generated_shared_prefix_requests,
    sample_random_requests,
    sample_sharegpt_requests,
)

BACKENDS: tuple[str, ...] = ("completions", "chat")
DEFAULT_BASE_URL = "http://127.0.0.1:30000"


class ServingBenchError(RuntimeError):
    """The benchmark cannot run at all (no model to name, bad dataset); single requests never raise."""


@dataclass
class ServingBenchConfig:
    base_url: str = DEFAULT_BASE_URL
    backend: str = "completions"
    model: str | None = None  # None: the first id listed by GET /v1/models
    api_key: str | None = None
    dataset: str = "random"
    num_prompts: int = 1000  # random and sharegpt; generated-shared-prefix sends groups x per-group
    seed: int = 1
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 1.0
    random_vocab_size: int = 10000
    gsp_num_groups: int = 64
    gsp_prompts_per_group: int = 16
    gsp_system_prompt_len: int = 2048
    gsp_question_len: int = 128
    gsp_output_len: int = 256
    dataset_path: str | None = None
    tokenizer: str | None = None
    sharegpt_output_len: int | None = None
    request_rate: float = math.inf  # requests/s; inf sends everything at t=0
    max_concurrency: int | None = None
    temperature: float = 0.0
    # Every dataset fixes output lengths; they only hold if the model may not stop early.
    ignore_eos: bool = True
    request_timeout: float | None = None  # seconds per request; None waits forever
    warmup_requests: int = 0
    disable_tqdm: bool = False
    output_file: str | None = None

    def validate(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.dataset not in DATASET_NAMES:
            raise ValueError(f"dataset must be one of {', '.join(DATASET_NAMES)}, got {self.dataset!r}")
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (inf for all at once), got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.warmup_requests < 0:
            raise ValueError(f"warmup_requests must be >= 0, got {self.warmup_requests}")
        if self.dataset == "sharegpt" and not self.dataset_path:
            raise ValueError("the sharegpt dataset needs dataset_path (--dataset-path)")


@dataclass
class RequestResult:
    success: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str | None = None
    # When it was sent, in seconds after the run started: the time axis of --plot's charts.
    start_s: float = 0.0

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; undefined for a single token."""
        if not self.success or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class LatencyStats:
    mean_ms: float = 0.0
    median_ms: float = 0.0
    p99_ms: float = 0.0

    @classmethod
    def from_seconds(cls, values: list[float]) -> LatencyStats:
        if not values:
            return cls()
        ms = sorted(v * 1000.0 for v in values)
        return cls(sum(ms) / len(ms), percentile(ms, 50), percentile(ms, 99))


@dataclass
class ServingMetrics:
    duration_s: float
    total_requests: int
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_token_throughput: float
    # Mean number of requests in flight: sum of request latencies over the wall time.
    concurrency: float
    ttft: LatencyStats
    itl: LatencyStats
    tpot: LatencyStats
    e2e: LatencyStats


@dataclass
class ServingReport:
    config: ServingBenchConfig
    model: str
    metrics: ServingMetrics
    first_error: str | None
    results: list[RequestResult] = field(repr=False)

    def to_dict(self) -> dict[str, Any]:
        """Aggregates and config, flat (`mean_ttft_ms`, ...) so jq and pandas read them directly."""
        metrics = asdict(self.metrics)
        out: dict[str, Any] = {"model": self.model, "backend": self.config.backend}
        out["dataset"] = self.config.dataset
        for name in ("ttft", "itl", "tpot", "e2e"):
            for stat, value in metrics.pop(name).items():
                out[f"{stat.removesuffix('_ms')}_{name}_ms"] = value
        out.update(metrics)
        out["first_error"] = self.first_error
        out["config"] = {k: _jsonable(v) for k, v in asdict(self.config).items() if k != "api_key"}
        out["timestamp"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        return out


def _jsonable(value: Any) -> Any:
    # json.dumps would write `Infinity`, which strict JSON parsers reject.
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def percentile(values: list[float], q: float) -> float:
    """numpy's percentile (linear between the closest ranks); 0 for no values."""
    return float(np.percentile(values, q)) if values else 0.0


def compute_metrics(results: list[RequestResult], duration_s: float) -> ServingMetrics:
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    return ServingMetrics(
        duration_s=duration_s,
        total_requests=len(results),
        completed=len(ok),
        failed=len(results) - len(ok),
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(ok) * per_s,
        input_throughput=input_tokens * per_s,
        output_throughput=output_tokens * per_s,
        total_token_throughput=(input_tokens + output_tokens) * per_s,
        concurrency=sum(r.e2e_s for r in ok) * per_s,
        ttft=LatencyStats.from_seconds([r.ttft_s for r in ok]),
        itl=LatencyStats.from_seconds([gap for r in ok for gap in r.itl_s]),
        tpot=LatencyStats.from_seconds([t for r in ok if (t := r.tpot_s) is not None]),
        e2e=LatencyStats.from_seconds([r.e2e_s for r in ok]),
    )


def build_requests(config: ServingBenchConfig) -> list[BenchRequest]:
    tokenizer = load_tokenizer(config.tokenizer) if config.tokenizer else None
    if config.dataset == "random":
        requests = sample_random_requests(
            config.num_prompts,
            config.random_input_len,
            config.random_output_len,
            config.random_range_ratio,
            config.random_vocab_size,
            config.seed,
        )
    elif config.dataset == "generated-shared-prefix":
        requests = sample_generated_shared_prefix_requests(
            config.gsp_num_groups,
            config.gsp_prompts_per_group,
            config.gsp_system_prompt_len,
            config.gsp_question_len,
            config.gsp_output_len,
            config.random_vocab_size,
            config.seed,
        )
    else:
        assert config.dataset_path is not None  # validate() checked
        requests = sample_sharegpt_requests(
            config.dataset_path, config.num_prompts, tokenizer, config.sharegpt_output_len, config.seed
        )
        if not requests:
            raise ServingBenchError(f"{config.dataset_path}: no conversation with a human/gpt exchange")
    if config.backend == "chat":
        # Chat messages carry text, so token-id prompts must become text first.
        if tokenizer is None and any(isinstance(r.prompt, list) for r in requests):
            raise ServingBenchError(
                f"--backend chat needs text prompts: use --dataset sharegpt, or pass --tokenizer so the "
                f"{config.dataset} token ids can be decoded"
            )
        if tokenizer is not None:
            requests = [
                BenchRequest(str(tokenizer.decode(r.prompt)), r.prompt_len, r.output_len)
                if isinstance(r.prompt, list)
                else r
                for r in requests
            ]
    return requests


def api_url(base_url: str, path: str) -> str:
    # OpenAI SDKs take base URLs ending in /v1; accept both spellings.
    base = base_url.rstrip("/").removesuffix("/v1")
    return f"{base}/v1/{path}"


def request_headers(config: ServingBenchConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}


def request_body(config: ServingBenchConfig, model: str, req: BenchRequest) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model}
    if config.backend == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    body.update(
        max_tokens=req.output_len,
        temperature=config.temperature,
        stream=True,
        stream_options={"include_usage": True},
    )
    # Sent only when on, so --no-ignore-eos yields a plain OpenAI body for strict servers.
    if config.ignore_eos:
        body["ignore_eos"] = True
    return body


def sse_data(line: str) -> str | None:
    """The payload of an SSE `data:` line; None for blank lines, comments and other fields."""
    if not line.startswith("data:"):
        return None
    return line[5:].strip()


def chunk_text(chunk: dict[str, Any], chat: bool) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
    return text or ""


async def send_request(
    client: httpx.AsyncClient,
    url: str,
    headers: dict[str, str],
    body: dict[str, Any],
    req: BenchRequest,
    origin: float | None = None,
) -> RequestResult:
    """Stream one request; every failure becomes a RequestResult with `error`, never an exception.
    `origin`: the run's start (perf_counter), which start_s counts from."""
    chat = "messages" in body
    itl: list[float] = []
    ttft: float | None = None
    last = 0.0
    content_chunks = 0
    usage: dict[str, Any] | None = None
    start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if not resp.is_success:
                detail = (await resp.aread()).decode("utf-8", errors="replace").strip()
                return RequestResult(False, error=f"HTTP {resp.status_code}: {detail[:300]}")
            async for line in resp.aiter_lines():
                payload = sse_data(line)
                if not payload:
                    continue
                if payload == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(payload)
                if chunk.get("error"):
                    return RequestResult(False, error=f"error in stream: {json.dumps(chunk['error'])[:300]}")
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if chunk_text(chunk, chat):
                    if ttft is None:
                        ttft = now - start
                    else:
                        itl.append(now - last)
                    last = now
                    content_chunks += 1
    except Exception as exc:  # connection refused, timeouts, bad JSON: count it, keep the run going
        return RequestResult(False, error=f"{type(exc).__name__}: {exc}")
    e2e = time.perf_counter() - start
    usage = usage or {}
    # Without usage (a server ignoring stream_options) a content chunk is the best token estimate.
    output_tokens = int(usage.get("completion_tokens") or content_chunks)
    prompt_tokens = int(usage.get("prompt_tokens") or req.prompt_len)
    return RequestResult(
        True,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        # A stream with no visible text still delivered its output by the end.
        ttft_s=e2e if ttft is None else ttft,
        e2e_s=e2e,
        itl_s=itl,
        start_s=0.0 if origin is None else start - origin,
    )


async def resolve_model(client: httpx.AsyncClient, config: ServingBenchConfig) -> str:
    if config.model:
        return config.model
    url = api_url(config.base_url, "models")
    try:
        resp = await client.get(url, headers=request_headers(config))
        resp.raise_for_status()
        return str(resp.json()["data"][0]["id"])
    except Exception as exc:
        raise ServingBenchError(f"could not read a model id from {url} ({exc}); pass --model") from exc


async def _run_all(
    config: ServingBenchConfig, client: httpx.AsyncClient, model: str, requests: list[BenchRequest]
) -> tuple[list[RequestResult], float, str | None]:
    url = api_url(config.base_url, "chat/completions" if config.backend == "chat" else "completions")
    headers = request_headers(config)
    semaphore = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    first_error: list[str] = []
    pbar = tqdm(total=len(requests), disable=config.disable_tqdm, desc="requests")

    async def one(req: BenchRequest) -> RequestResult:
        body = request_body(config, model, req)
        # `start` is set below, before the first of these tasks is created.
        if semaphore is None:
            result = await send_request(client, url, headers, body, req, start)
        else:
            # Latencies start once the request holds a slot: queueing in the client is not the server's.
            async with semaphore:
                result = await send_request(client, url, headers, body, req, start)
        if result.error and not first_error:
            first_error.append(result.error)
            tqdm.write(f"first failed request: {result.error}", file=sys.stderr)
        pbar.update(1)
        return result

    for i in range(config.warmup_requests):
        warm = requests[i % len(requests)]
        result = await send_request(client, url, headers, request_body(config, model, warm), warm)
        if result.error:
            tqdm.write(f"warm-up request failed: {result.error}", file=sys.stderr)

    rng = random.Random(config.seed)
    tasks: list[asyncio.Task[RequestResult]] = []
    start = time.perf_counter()
    arrival = 0.0
    try:
        for i, req in enumerate(requests):
            if i > 0 and math.isfinite(config.request_rate):
                # Sleep to absolute arrival times so task-creation overhead never lowers the rate.
                arrival += rng.expovariate(config.request_rate)
                delay = start + arrival - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req)))
        results = list(await asyncio.gather(*tasks))
    finally:
        pbar.close()
    duration = time.perf_counter() - start
    return results, duration, (first_error[0] if first_error else None)


async def run_serving_benchmark(config: ServingBenchConfig) -> ServingReport:
    """Build the dataset, resolve the model, send every request, aggregate, and write the JSON."""
    config.validate()
    requests = build_requests(config)
    timeout = httpx.Timeout(config.request_timeout)
    # httpx pools at most 100 connections by default; beyond that requests would queue inside the
    # client and the wait would count as server latency. trust_env=False: a proxy from the
    # environment must not sit between the benchmark and a local server.
    limits = httpx.Limits(max_connections=config.max_concurrency, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        model = await resolve_model(client, config)
        results, duration, first_error = await _run_all(config, client, model, requests)
    report = ServingReport(config, model, compute_metrics(results, duration), first_error, results)
    if config.output_file:
        path = Path(config.output_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    return report


def format_report(report: ServingReport) -> str:
    m, cfg = report.metrics, report.config
    width = 50
    rows: list[str] = [" Serving Benchmark Result ".center(width, "=")]

    def row(label: str, value: Any) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        rows.append(f"{label:<36}{text:>14}")

    row("Backend:", cfg.backend)
    row("Model:", report.model)
    row("Dataset:", cfg.dataset)
    row("Request rate (req/s):", cfg.request_rate)
    row("Max concurrency:", cfg.max_concurrency or "unlimited")
    row("Successful requests:", m.completed)
    row("Failed requests:", m.failed)
    row("Benchmark duration (s):", m.duration_s)
    row("Total input tokens:", m.total_input_tokens)
    row("Total output tokens:", m.total_output_tokens)
    row("Request throughput (req/s):", m.request_throughput)
    row("Input token throughput (tok/s):", m.input_throughput)
    row("Output token throughput (tok/s):", m.output_throughput)
    row("Total token throughput (tok/s):", m.total_token_throughput)
    row("Concurrency:", m.concurrency)
    titles = {
        "ttft": ("Time to First Token", "TTFT"),
        "itl": ("Inter-token Latency", "ITL"),
        "tpot": ("Time per Output Token (excl. 1st)", "TPOT"),
        "e2e": ("End-to-end Latency", "E2E"),
    }
    for name, (title, short) in titles.items():
        stats: LatencyStats = getattr(m, name)
        rows.append(f" {title} ".center(width, "-"))
        row(f"Mean {short} (ms):", stats.mean_ms)
        row(f"Median {short} (ms):", stats.median_ms)
        row(f"P99 {short} (ms):", stats.p99_ms)
    rows.append("=" * width)
    if report.first_error:
        rows.append(f"First error: {report.first_error}")
    return "\n".join(rows)
