"""The request scenarios of the soak harness (radixserve_tools/bench/soak.py) and the checks of their
answers."""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections.abc import Callable
from typing import Any

import httpx

from radixserve_tools.bench.serving import (
    ServingBenchConfig,
    api_url,
    chunk_text,
    request_headers,
    sse_data,
)
from radixserve_tools.bench.soak_report import (
    JSON_SCHEMA,
    PREFIX_GROUP,
    REGEX,
    WORDS,
    Limits,
    Result,
    SoakConfig,
)


class Client:
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


class Scenarios:
    """Builds and runs one scenario (one or more HTTP generation requests) of each kind."""

    def __init__(self, client: Client, run_id: str) -> None:
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
