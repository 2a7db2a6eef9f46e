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
import json
import random
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from radixserve.bench.serving import (
    DEFAULT_BASE_URL,
    ServingBenchConfig,
    api_url,
    chunk_text,
    percentile,
    request_headers,
    resolve_model,
    sse_data,
)

# Scenario kinds and their weights in the mix.
KIND_WEIGHTS: dict[str, float] = {
    "native": 10,
    "native_stream": 10,
    "completion": 8,
    "completion_stream": 8,
    "completion_n": 4,  # n > 1 with a seed, streaming or not
    "chat": 8,
    "chat_stream": 8,
    "disconnect_stream": 6,  # read a few chunks, then hang up
    "disconnect_wait": 3,  # hang up on a non-streaming request before it ends
    "abort_rid": 5,  # /abort_request {"rid": rid} once it streams
    "abort_prefix": 3,  # three requests sharing a rid prefix, aborted by that prefix
    "session": 5,  # open, 2-4 turns, close
    "grammar_json": 5,
    "grammar_regex": 5,
    "long_prompt": 5,  # prompt near min(context, KV pool)
    "too_long": 1,  # prompt past the context: must be a 400
}
PREFIX_GROUP = 3
JSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{1,8}( [a-z]{1,8}){0,3}"
WORDS = re.findall(
    r"\w+",
    "the of and to in is it you that he was for on are with as his they be at one have this from "
    "or had by word but what some we can out other were all there when up use your how said an "
    "each she which do their time if will way about many then them write would like so these",
)
OUTCOMES = ("ok", "aborted", "client_disconnected", "expected_4xx", "4xx", "5xx", "transport_error")


@dataclass
class SoakConfig:
    base_url: str = DEFAULT_BASE_URL
    api_key: str | None = None
    model: str | None = None  # None: the first id of GET /v1/models
    num_requests: int = 10_000
    concurrency: int = 16
    seed: int = 1
    server_pid: int | None = None
    request_timeout: float = 120.0  # seconds per HTTP request
    idle_timeout: float = 120.0  # seconds to wait for the server to go idle after the run
    max_duration: float | None = None  # stop starting new requests after this many seconds
    max_rss_growth: float = 0.05
    max_tokens: int = 128  # the largest output asked for (tiny ones are 1-4 tokens)
    out: str | None = None
    disable_tqdm: bool = False

    def validate(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.max_tokens < 8:
            raise ValueError(f"max_tokens must be >= 8, got {self.max_tokens}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if not self.request_timeout > 0 or not self.idle_timeout > 0:
            raise ValueError("request_timeout and idle_timeout must be > 0")


@dataclass
class Result:
    """One HTTP generation request."""

    kind: str
    outcome: str  # one of OUTCOMES
    status: int = 200
    latency_s: float = 0.0
    error: str | None = None
    malformed: str | None = None  # the answer came back but breaks the API's promises
    unexpected: bool = False  # a 4xx or an abort where none was asked for


@dataclass
class Limits:
    """What the server allows, read from it before the run."""

    context_len: int
    max_total_tokens: int
    vocab_size: int

    @property
    def prompt_room(self) -> int:
        # A prompt must be shorter than the context and fit the KV pool with its output.
        return min(self.context_len - 1, self.max_total_tokens)


@dataclass
class SoakReport:
    config: dict[str, Any]
    model: str
    duration_s: float
    requests: int
    outcomes: dict[str, int]
    by_status: dict[str, int]
    by_kind: dict[str, dict[str, int]]
    malformed: int
    unexpected: int
    server_retracted: int
    server_aborted: int
    kv_invariant: str
    idle: bool
    rss_kb: dict[str, dict[str, int]]  # start, third, middle, end -> {pid: kB, "total": kB}
    rss_growth: float | None  # over the last two thirds (end vs the sample at one third)
    p50_ms: float
    p99_ms: float
    checks: dict[str, bool]
    first_errors: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(self.checks.values())

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed, "timestamp": _now()}


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# --------------------------------------------------------------------------------------------
# RSS of the server and its descendants
# --------------------------------------------------------------------------------------------


def _parent_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The parent pid is the 2nd field after the parenthesized command name.
    return int(stat.rsplit(")", 1)[1].split()[1])


def process_tree(pid: int) -> list[int]:
    """pid and all its descendants (that are alive now)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (ppid := _parent_of(int(entry.name))) is not None:
            parents[int(entry.name)] = ppid
    tree, frontier = [pid], [pid]
    while frontier:
        frontier = [child for child, ppid in parents.items() if ppid in frontier]
        tree += frontier
    return tree


def rss_kb(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def sample_rss(pid: int | None) -> dict[str, int]:
    if pid is None:
        return {}
    sample = {str(p): kb for p in process_tree(pid) if (kb := rss_kb(p)) is not None}
    sample["total"] = sum(sample.values())
    return sample


# --------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------


class _Client:
    """The HTTP side: one pool for generation requests, one for control calls (never starved)."""

    def __init__(self, config: SoakConfig, model: str, limits: Limits) -> None:
        self.config, self.model, self.limits = config, model, limits
        self.base = config.base_url.rstrip("/").removesuffix("/v1")
        self.headers = request_headers(ServingBenchConfig(api_key=config.api_key))
        timeout = httpx.Timeout(config.request_timeout)
        pool = httpx.Limits(max_connections=config.concurrency * (PREFIX_GROUP + 1) + 4)
        self.http = httpx.AsyncClient(timeout=timeout, limits=pool, trust_env=False)
        self.control = httpx.AsyncClient(timeout=timeout, trust_env=False)

    async def aclose(self) -> None:
        await self.http.aclose()
        await self.control.aclose()

    async def control_post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return await self.control.post(f"{self.base}{path}", json=body, headers=self.headers)

    async def server_info(self) -> dict[str, Any]:
        resp = await self.control.get(f"{self.base}/get_server_info", headers=self.headers)
        resp.raise_for_status()
        info: dict[str, Any] = resp.json()
        return info

    def url(self, kind: str) -> str:
        if kind == "native":
            return f"{self.base}/generate"
        return api_url(self.config.base_url, "chat/completions" if kind == "chat" else "completions")


class _Scenarios:
    """Builds and runs one scenario (one or more HTTP generation requests) of each kind."""

    def __init__(self, client: _Client, run_id: str) -> None:
        self.c = client
        self.run_id = run_id

    # ---- request bodies -------------------------------------------------------------------

    @property
    def cap(self) -> int:
        return self.c.config.max_tokens

    def hang_up_len(self, rng: random.Random) -> int:
        return rng.randint(self.cap // 4, self.cap)

    def grammar_len(self, rng: random.Random) -> int:
        # Room for the grammar to end: a JSON object or four words fit in 24 tokens.
        return rng.randint(24, max(24, self.cap // 2))

    def text(self, rng: random.Random, words: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(words))

    def max_tokens(self, rng: random.Random) -> int:
        return rng.choice((1, 2, 4)) if rng.random() < 0.3 else rng.randint(8, self.cap * 3 // 4)

    def sampling(self, rng: random.Random) -> dict[str, Any]:
        return {"temperature": rng.choice((0.0, 0.7, 1.0)), "ignore_eos": rng.random() < 0.5}

    def native_body(self, rng: random.Random, rid: str | None = None) -> dict[str, Any]:
        params = {"max_new_tokens": self.max_tokens(rng), **self.sampling(rng)}
        body: dict[str, Any] = {"text": self.text(rng, rng.randint(2, 40)), "sampling_params": params}
        if rid is not None:
            body["rid"] = rid
        return body

    def openai_body(self, rng: random.Random, chat: bool, **extra: Any) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.c.model,
            "max_tokens": self.max_tokens(rng),
            **self.sampling(rng),
        }
        prompt = self.text(rng, rng.randint(2, 40))
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        body.update(extra)
        return body

    # ---- one HTTP request ------------------------------------------------------------------

    async def send(
        self,
        kind: str,
        route: str,
        body: dict[str, Any],
        *,
        stream: bool,
        expect_status: int = 200,
        hang_up_after_chunks: int | None = None,
        hang_up_after_s: float | None = None,
        on_first_chunk: asyncio.Event | None = None,
        expect_abort: bool = False,
        check: Callable[[dict[str, Any]], str | None] | None = None,
    ) -> tuple[Result, Any]:
        """Sends one request, classifies the outcome; returns it and the final payload (or None)."""
        body = {**body, "stream": stream}
        n = int(body.get("n", 1))
        if stream and route != "native":
            body["stream_options"] = {"include_usage": True}
        start = time.perf_counter()
        try:
            if hang_up_after_s is not None:
                try:
                    coro = self._exchange(route, body, stream, n, None, on_first_chunk)
                    status, final, problem = await asyncio.wait_for(coro, hang_up_after_s)
                except (asyncio.TimeoutError, TimeoutError):
                    return Result(kind, "client_disconnected"), None
            else:
                status, final, problem = await self._exchange(
                    route, body, stream, n, hang_up_after_chunks, on_first_chunk
                )
        except Exception as exc:  # refused, reset, timed out: count it, keep going
            return Result(kind, "transport_error", 0, error=f"{type(exc).__name__}: {exc}"), None
        latency = time.perf_counter() - start
        if on_first_chunk is not None:
            on_first_chunk.set()
        if status == -1:
            return Result(kind, "client_disconnected"), None
        if status != 200:
            outcome = "5xx" if status >= 500 else ("expected_4xx" if status == expect_status else "4xx")
            return Result(kind, outcome, status, error=str(problem)[:300], unexpected=outcome == "4xx"), None
        if expect_status != 200:
            return Result(kind, "ok", malformed=f"expected HTTP {expect_status}, got 200"), final
        finish = _finish_reasons(route, final)
        if problem is None and check is not None and "abort" not in finish:
            problem = check(final)
        if "abort" in finish:
            return Result(
                kind, "aborted", latency_s=latency, malformed=problem, unexpected=not expect_abort
            ), final
        return Result(kind, "ok", latency_s=latency, malformed=problem), final

    async def _exchange(
        self,
        route: str,
        body: dict[str, Any],
        stream: bool,
        n: int,
        hang_up_after_chunks: int | None,
        on_first_chunk: asyncio.Event | None,
    ) -> tuple[int, Any, str | None]:
        """(status, final payload, problem); status -1 when this client hung up on purpose."""
        url, headers = self.c.url(route), self.c.headers
        if not stream:
            resp = await self.c.http.post(url, json=body, headers=headers)
            if resp.status_code != 200:
                return resp.status_code, None, resp.text
            payload = resp.json()
            return 200, payload, _check_payload(route, payload, n)
        async with self.c.http.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                return resp.status_code, None, (await resp.aread()).decode(errors="replace")
            chunks: list[dict[str, Any]] = []
            done = False
            async for line in resp.aiter_lines():
                data = sse_data(line)
                if not data:
                    continue
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    return 200, None, f"error event in stream: {json.dumps(chunk['error'])[:300]}"
                chunks.append(chunk)
                if on_first_chunk is not None:
                    on_first_chunk.set()
                if hang_up_after_chunks is not None and len(chunks) >= hang_up_after_chunks:
                    return -1, None, None  # leaving the block closes the connection mid-stream
        if not done:
            return 200, None, "stream ended without [DONE]"
        return 200, *_merge_stream(route, chunks, n)

    # ---- scenarios --------------------------------------------------------------------------

    async def run(self, kind: str, index: int, rng: random.Random, size: int) -> list[Result]:
        rid_base = f"soak{self.run_id}-{index}-"
        if kind in ("native", "native_stream"):
            body = self.native_body(rng, rid_base + "r")
            return [(await self.send(kind, "native", body, stream=kind == "native_stream"))[0]]
        if kind in ("completion", "completion_stream", "chat", "chat_stream"):
            route = kind.removesuffix("_stream")
            body = self.openai_body(rng, route == "chat")
            return [(await self.send(kind, route, body, stream=kind.endswith("_stream")))[0]]
        if kind == "completion_n":
            chat = rng.random() < 0.5
            body = self.openai_body(rng, chat, n=rng.randint(2, 4), seed=rng.randint(0, 2**31 - 1))
            route = "chat" if chat else "completion"
            return [(await self.send(kind, route, body, stream=rng.random() < 0.5))[0]]
        if kind == "disconnect_stream":
            body = self.native_body(rng) if rng.random() < 0.5 else self.openai_body(rng, rng.random() < 0.5)
            route = "native" if "text" in body else ("chat" if "messages" in body else "completion")
            if route == "native":
                body["sampling_params"].update(max_new_tokens=self.hang_up_len(rng), ignore_eos=True)
            else:
                body.update(max_tokens=self.hang_up_len(rng), ignore_eos=True)
            after = rng.randint(1, 8)
            return [(await self.send(kind, route, body, stream=True, hang_up_after_chunks=after))[0]]
        if kind == "disconnect_wait":
            body = self.native_body(rng)
            body["sampling_params"].update(max_new_tokens=self.hang_up_len(rng), ignore_eos=True)
            wait = rng.uniform(0.005, 0.2)
            return [(await self.send(kind, "native", body, stream=False, hang_up_after_s=wait))[0]]
        if kind == "abort_rid":
            return [await self.abort_one(kind, rid_base + "a", rng, rid_base + "a")]
        if kind == "abort_prefix":
            return await self.abort_group(kind, rid_base, rng)
        if kind == "session":
            return await self.session(kind, rng, size)
        if kind == "grammar_json":
            chat = rng.random() < 0.5
            fmt = {"type": "json_schema", "json_schema": {"name": "soak", "schema": JSON_SCHEMA}}
            body = self.openai_body(rng, chat, response_format=fmt)
            body["max_tokens"] = self.grammar_len(rng)
            body.pop("ignore_eos")
            route = "chat" if chat else "completion"
            return [(await self.send(kind, route, body, stream=rng.random() < 0.5, check=_check_json))[0]]
        if kind == "grammar_regex":
            body = self.openai_body(rng, False, regex=REGEX)
            body["max_tokens"] = self.grammar_len(rng)
            body.pop("ignore_eos")
            return [
                (await self.send(kind, "completion", body, stream=rng.random() < 0.5, check=_check_regex))[0]
            ]
        if kind == "long_prompt":
            out = rng.choice((1, 4, 16))
            length = max(1, self.c.limits.prompt_room - out - rng.randint(0, 16))
            body = {"input_ids": self.ids(rng, length), "sampling_params": {"max_new_tokens": out}}
            return [(await self.send(kind, "native", body, stream=rng.random() < 0.5))[0]]
        if kind == "too_long":
            body = {"input_ids": self.ids(rng, self.c.limits.context_len + rng.randint(0, 8))}
            return [(await self.send(kind, "native", body, stream=False, expect_status=400))[0]]
        raise ValueError(f"unknown scenario kind {kind!r}")

    def ids(self, rng: random.Random, length: int) -> list[int]:
        lo = min(16, self.c.limits.vocab_size - 1)
        return [rng.randrange(lo, self.c.limits.vocab_size) for _ in range(length)]

    def long_native(self, rng: random.Random, rid: str) -> dict[str, Any]:
        body = self.native_body(rng, rid)
        body["sampling_params"].update(max_new_tokens=rng.randint(self.cap // 2, self.cap), ignore_eos=True)
        return body

    async def abort_one(self, kind: str, rid: str, rng: random.Random, abort_rid: str) -> Result:
        first = asyncio.Event()
        task = asyncio.create_task(
            self.send(
                kind,
                "native",
                self.long_native(rng, rid),
                stream=True,
                on_first_chunk=first,
                expect_abort=True,
            )
        )
        await self._abort_when_started([first], [task], abort_rid)
        return (await task)[0]

    async def abort_group(self, kind: str, prefix: str, rng: random.Random) -> list[Result]:
        events = [asyncio.Event() for _ in range(PREFIX_GROUP)]
        tasks = [
            asyncio.create_task(
                self.send(
                    kind,
                    "native",
                    self.long_native(rng, f"{prefix}{j}"),
                    stream=rng.random() < 0.5,
                    on_first_chunk=events[j],
                    expect_abort=True,
                )
            )
            for j in range(PREFIX_GROUP)
        ]
        # Non-streaming members never signal a first chunk: abort once the streaming ones run.
        await asyncio.sleep(rng.uniform(0.0, 0.05))
        await self._abort_when_started(events, tasks, prefix)
        return [(await t)[0] for t in tasks]

    async def _abort_when_started(
        self, events: list[asyncio.Event], tasks: list[asyncio.Task[Any]], rid: str
    ) -> None:
        waits = [asyncio.create_task(e.wait()) for e in events]
        # Bounded: a request stuck in the queue still gets aborted (there) after the timeout.
        await asyncio.wait(
            waits, timeout=self.c.config.request_timeout / 4, return_when=asyncio.FIRST_COMPLETED
        )
        for w in waits:
            w.cancel()
        resp = await self.c.control_post("/abort_request", {"rid": rid})
        resp.raise_for_status()

    async def session(self, kind: str, rng: random.Random, turns: int) -> list[Result]:
        resp = await self.c.control_post("/open_session", {})
        resp.raise_for_status()
        session_id = resp.json()
        results: list[Result] = []
        try:
            for _ in range(turns):
                body = self.native_body(rng)
                body["sampling_params"]["max_new_tokens"] = rng.randint(1, 16)
                body["text"] = self.text(rng, rng.randint(1, 12))
                body["session_params"] = {"id": session_id}
                result, _ = await self.send(kind, "native", body, stream=rng.random() < 0.5)
                results.append(result)
                if result.outcome != "ok":
                    break
        finally:
            close = await self.c.control_post("/close_session", {"session_id": session_id})
            close.raise_for_status()
        return results


def _finish_reasons(route: str, final: Any) -> list[str]:
    if final is None:
        return []
    if route == "native":
        reason = (final.get("meta_info") or {}).get("finish_reason") or {}
        return [str(reason.get("type"))]
    return [str(c.get("finish_reason")) for c in final.get("choices") or []]


def _check_payload(route: str, payload: Any, n: int) -> str | None:
    if not isinstance(payload, dict):
        return f"not a JSON object: {str(payload)[:200]}"
    if route == "native":
        meta = payload.get("meta_info") or {}
        if not isinstance(payload.get("text"), str) or not meta.get("finish_reason"):
            return f"native answer without text or finish_reason: {json.dumps(payload)[:300]}"
        return None
    choices = payload.get("choices") or []
    if sorted(c.get("index") for c in choices) != list(range(n)):
        return f"expected choices 0..{n - 1}, got {[c.get('index') for c in choices]}"
    if any(c.get("finish_reason") not in ("stop", "length", "abort") for c in choices):
        return f"bad finish_reason in {[c.get('finish_reason') for c in choices]}"
    if not payload.get("usage"):
        return "no usage"
    return None


def _merge_stream(route: str, chunks: list[dict[str, Any]], n: int) -> tuple[Any, str | None]:
    """The streamed chunks as one non-streaming payload (text joined), and what is wrong with it."""
    if route == "native":
        if not chunks:
            return None, "native stream without a result"
        final = chunks[-1]  # native streams send the cumulative result each step
        return final, _check_payload(route, final, n)
    chat = route == "chat"
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage = None
    for chunk in chunks:
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices") or []:
            index = int(choice.get("index", 0))
            texts[index] = texts.get(index, "") + chunk_text({"choices": [choice]}, chat)
            if choice.get("finish_reason"):
                if index in finish:
                    return None, f"choice {index} finished twice"
                finish[index] = choice["finish_reason"]
    choices = [
        {
            "index": i,
            "finish_reason": finish.get(i),
            "text" if not chat else "message": t if not chat else {"content": t},
        }
        for i, t in sorted(texts.items())
    ]
    payload = {"choices": choices, "usage": usage}
    return payload, _check_payload(route, payload, n)


def _choice_texts(final: dict[str, Any]) -> list[tuple[str, str]]:
    out = []
    for choice in final.get("choices") or []:
        text = choice["message"]["content"] if "message" in choice else choice.get("text")
        out.append((str(choice.get("finish_reason")), text or ""))
    return out


def _check_json(final: dict[str, Any]) -> str | None:
    for reason, text in _choice_texts(final):
        if reason != "stop":
            continue  # cut by max_tokens: a prefix of valid JSON
        try:
            value = json.loads(text)
        except ValueError:
            return f"json_schema output is not JSON: {text[:200]!r}"
        if not isinstance(value, dict) or set(value) != {"ok", "n"} or not isinstance(value["ok"], bool):
            return f"json_schema output breaks the schema: {text[:200]!r}"
    return None


def _check_regex(final: dict[str, Any]) -> str | None:
    for reason, text in _choice_texts(final):
        if reason == "stop" and not re.fullmatch(REGEX, text):
            return f"regex output does not match: {text[:200]!r}"
    return None


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


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


async def _read_limits(client: _Client) -> Limits:
    info = await client.server_info()
    resp = await client.control.get(f"{client.base}/get_model_info", headers=client.headers)
    model_info = resp.json() if resp.status_code == 200 else {}
    context = int(model_info.get("context_length") or info.get("context_len") or 2048)
    pool = int(info.get("max_total_tokens") or context)
    vocab = int(model_info.get("vocab_size") or 32000)
    return Limits(context, pool, vocab)


async def _wait_idle(client: _Client, timeout: float) -> dict[str, Any]:
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
    client = _Client(config, model, Limits(0, 0, 0))
    try:
        client.limits = await _read_limits(client)
        report = await _run(config, client, scenarios)
    finally:
        await client.aclose()
    if config.out:
        write_report(report, config.out)
    return report


async def _run(
    config: SoakConfig, client: _Client, scenarios: list[tuple[str, random.Random, int]]
) -> SoakReport:
    runner = _Scenarios(client, f"{random.Random(config.seed).getrandbits(32):08x}{time.time_ns() % 10**6}")
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


def build_report(
    config: SoakConfig,
    model: str,
    results: list[Result],
    duration: float,
    before: dict[str, Any],
    after: dict[str, Any],
    rss: dict[str, dict[str, int]],
) -> SoakReport:
    outcomes = Counter({name: 0 for name in OUTCOMES})
    outcomes.update(r.outcome for r in results)
    by_status = Counter(str(r.status) for r in results if r.outcome in ("4xx", "5xx", "expected_4xx"))
    by_kind: dict[str, Counter[str]] = {}
    for r in results:
        by_kind.setdefault(r.kind, Counter())[r.outcome] += 1
    latencies = sorted(r.latency_s * 1000 for r in results if r.outcome == "ok")
    growth = None
    if rss.get("third", {}).get("total") and rss.get("end", {}).get("total"):
        growth = rss["end"]["total"] / rss["third"]["total"] - 1.0
    malformed = sum(r.malformed is not None for r in results)
    unexpected = sum(r.unexpected for r in results)
    checks = {
        "no 5xx": outcomes["5xx"] == 0,
        "no transport errors": outcomes["transport_error"] == 0,
        "no malformed answers": malformed == 0,
        "no unexpected 4xx or aborts": unexpected == 0,
        "server idle after the run": bool(after.get("idle")),
        "kv_invariant ok": after.get("kv_invariant") == "ok",
    }
    if growth is not None:
        checks[f"RSS growth over the last two thirds <= {config.max_rss_growth:.0%}"] = (
            growth <= config.max_rss_growth
        )
    errors = [
        f"{r.kind}: {r.malformed or r.error}"
        for r in results
        if r.malformed or r.outcome in ("4xx", "5xx", "transport_error")
    ]
    return SoakReport(
        config={k: v for k, v in asdict(config).items() if k != "api_key"},
        model=model,
        duration_s=duration,
        requests=len(results),
        outcomes=dict(outcomes),
        by_status=dict(by_status),
        by_kind={k: dict(v) for k, v in sorted(by_kind.items())},
        malformed=malformed,
        unexpected=unexpected,
        server_retracted=int(after.get("retracted_reqs", 0)) - int(before.get("retracted_reqs", 0)),
        server_aborted=int(after.get("aborted_reqs", 0)) - int(before.get("aborted_reqs", 0)),
        kv_invariant=str(after.get("kv_invariant")),
        idle=bool(after.get("idle")),
        rss_kb=rss,
        rss_growth=growth,
        p50_ms=percentile(latencies, 50),
        p99_ms=percentile(latencies, 99),
        checks=checks,
        first_errors=errors[:10],
    )


def write_report(report: SoakReport, path: str) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report.to_dict(), indent=2) + "\n")


def format_report(report: SoakReport) -> str:
    width = 60
    rows = [" Soak Result ".center(width, "=")]

    def row(label: str, value: Any) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        rows.append(f"{label:<42}{text:>18}")

    row("Model:", report.model)
    row("Requests:", report.requests)
    row("Duration (s):", report.duration_s)
    rows.append(" Outcomes ".center(width, "-"))
    for name in OUTCOMES:
        row(f"{name}:", report.outcomes.get(name, 0))
    for status, count in sorted(report.by_status.items()):
        row(f"  HTTP {status}:", count)
    row("malformed answers:", report.malformed)
    row("unexpected 4xx / aborts:", report.unexpected)
    rows.append(" Server ".center(width, "-"))
    row("retracted requests (server):", report.server_retracted)
    row("aborted requests (server):", report.server_aborted)
    row("idle after the run:", report.idle)
    row("kv_invariant:", report.kv_invariant)
    for phase, sample in report.rss_kb.items():
        if sample:
            row(f"RSS {phase} (MiB, {len(sample) - 1} processes):", sample["total"] / 1024)
    row("RSS growth, last two thirds:", "n/a" if report.rss_growth is None else f"{report.rss_growth:+.2%}")
    rows.append(" Latency of completed requests ".center(width, "-"))
    row("p50 (ms):", report.p50_ms)
    row("p99 (ms):", report.p99_ms)
    rows.append(" Checks ".center(width, "-"))
    for name, ok in report.checks.items():
        row(f"{name}:", "PASS" if ok else "FAIL")
    rows.append("=" * width)
    rows += [f"error: {e}" for e in report.first_errors]
    return "\n".join(rows)


def main(config: SoakConfig) -> int:
    """Runs the soak, prints the table, writes --out; 0 when every check passed."""
    report = asyncio.run(run_soak(config))
    print(format_report(report))
    if config.out:
        print(f"wrote {config.out}")
    return 0 if report.passed else 1
