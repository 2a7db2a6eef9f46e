"""`radixserve bench soak`: a fault and soak harness against any running server.

Sends a seeded mix of requests at a bounded concurrency: native /generate (streaming or not),
OpenAI completions and chat (streaming or not, some with n > 1 and a seed), clients that hang up
mid-request, aborts through /abort_request by rid and by rid prefix of requests in flight,
sessions (open, a few turns, close), grammar requests (json_schema, regex), prompts near the
context or KV-pool limit, a prompt past the context (a 400 is the right answer), and tiny and
larger max_tokens. Then it waits for the server to go idle and checks what must hold after any
such run:

- no 5xx, no transport error (beyond the deliberate hang-ups), no malformed answer, no 4xx or
  abort where none was asked for;
- the server's KV accounting is intact once idle (/get_server_info `kv_invariant` == "ok");
- the RSS of the server process and its descendants (`--server-pid`) grows at most 5% over the
  last two thirds of the run.

It also reports the retractions and aborts the server counted (/get_server_info before and
after) and p50/p99 latency of the completed requests. Every loop is bounded in count and time
and every request goes to the given base URL only.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import httpx
from tqdm import tqdm

from radixserve_tools.bench.serving import (
    ServingBenchConfig,
    resolve_model,
)
from radixserve_tools.bench.soak_report import (
    KIND_WEIGHTS,
    PREFIX_GROUP,
    Limits,
    Result,
    SoakConfig,
    SoakReport,
    build_report,
    format_report,
    sample_rss,
    write_report,
)
from radixserve_tools.bench.soak_scenarios import Client, Scenarios


def plan(config: SoakConfig) -> list[tuple[str, random.Random, int]]:
    """The seeded scenarios (kind, rng, requests), whose request counts add up to num_requests."""
    rng = random.Random(config.seed)
    kinds, weights = list(KIND_WEIGHTS), list(KIND_WEIGHTS.values())
    out: list[tuple[str, random.Random, int]] = []
    total = 0
    while total < config.num_requests:
        kind = rng.choices(kinds, weights)[0]
        size = {"abort_prefix": PREFIX_GROUP, "session": rng.randint(2, 4)}.get(kind, 1)
        if total + size > config.num_requests:
            kind, size = "native", 1
        out.append((kind, random.Random(rng.getrandbits(64)), size))
        total += size
    return out


async def _read_limits(client: Client) -> Limits:
    info = await client.server_info()
    resp = await client.control.get(f"{client.base}/get_model_info", headers=client.headers)
    model_info = resp.json() if resp.status_code == 200 else {}
    context = int(model_info.get("context_length") or info.get("context_len") or 2048)
    pool = int(info.get("max_total_tokens") or context)
    vocab = int(model_info.get("vocab_size") or 32000)
    return Limits(context, pool, vocab)


async def _wait_idle(client: Client, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    info = await client.server_info()
    while not info.get("idle") and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        info = await client.server_info()
    return info


async def run_soak(config: SoakConfig) -> SoakReport:
    """Runs the soak and returns the report (also written to config.out when set)."""
    config.validate()
    scenarios = plan(config)
    async with httpx.AsyncClient(timeout=httpx.Timeout(config.request_timeout), trust_env=False) as probe:
        model = await resolve_model(
            probe, ServingBenchConfig(base_url=config.base_url, api_key=config.api_key, model=config.model)
        )
    client = Client(config, model, Limits(0, 0, 0))
    try:
        client.limits = await _read_limits(client)
        report = await _run(config, client, scenarios)
    finally:
        await client.aclose()
    if config.out:
        write_report(report, config.out)
    return report


async def _run(
    config: SoakConfig, client: Client, scenarios: list[tuple[str, random.Random, int]]
) -> SoakReport:
    runner = Scenarios(client, f"{random.Random(config.seed).getrandbits(32):08x}{time.time_ns() % 10**6}")
    before = await client.server_info()
    rss: dict[str, dict[str, int]] = {"start": sample_rss(config.server_pid)}
    results: list[Result] = []
    semaphore = asyncio.Semaphore(config.concurrency)
    pbar = tqdm(total=config.num_requests, disable=config.disable_tqdm, desc="soak requests")
    start = time.perf_counter()
    third, half = config.num_requests / 3, config.num_requests / 2
    stopped = False

    async def one(index: int, kind: str, rng: random.Random, size: int) -> None:
        nonlocal stopped
        async with semaphore:
            if stopped or (
                config.max_duration is not None and time.perf_counter() - start > config.max_duration
            ):
                stopped = True
                return
            try:
                got = await runner.run(kind, index, rng, size)
            except httpx.HTTPStatusError as exc:  # a control call (abort, session) refused
                code = exc.response.status_code
                outcome = "5xx" if code >= 500 else "4xx"
                got = [Result(kind, outcome, code, error=f"control call: {exc}", unexpected=True)]
            except Exception as exc:  # a control call that never got an answer
                got = [Result(kind, "transport_error", 0, error=f"control call: {type(exc).__name__}: {exc}")]
        results.extend(got)
        pbar.update(len(got))
        for phase, at in (("third", third), ("middle", half)):
            if phase not in rss and len(results) >= at:
                rss[phase] = sample_rss(config.server_pid)

    try:
        await asyncio.gather(*(one(i, kind, rng, size) for i, (kind, rng, size) in enumerate(scenarios)))
    finally:
        pbar.close()
    duration = time.perf_counter() - start
    after = await _wait_idle(client, config.idle_timeout)
    rss["end"] = sample_rss(config.server_pid)
    return build_report(config, client.model, results, duration, before, after, rss)


def main(config: SoakConfig) -> SoakReport:
    """Runs the soak, prints the table, writes --out; the report (whether it `passed` is the exit
    status)."""
    report = asyncio.run(run_soak(config))
    print(format_report(report))
    if config.out:
        print(f"wrote {config.out}")
    return report
