"""GET /dashboard (--enable-dashboard): a live page of the server's state, served from the package
(static/dashboard.html: no CDN, no network), fed by Server-Sent Events about twice a second.

Each snapshot joins the engine's request timings (runtime/live_stats.py) with every data-parallel
replica's scheduler state (the "dashboard_state" control command: queues, KV split, radix tree).
With --api-key a browser cannot send a bearer header, so /dashboard?api_key=KEY answers with an
HttpOnly cookie scoped to /dashboard and a redirect that drops the key from the address; the
middleware accepts that cookie on the dashboard's routes only (dashboard_authorized).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
from collections.abc import AsyncIterator, Mapping
from http.cookies import SimpleCookie
from importlib import resources
from typing import Any
from urllib.parse import parse_qs

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response, StreamingResponse

from radixserve.runtime.engine import Engine
from radixserve.server.openai_api import engine_of

DASHBOARD_PATH = "/dashboard"
COOKIE = "radixserve_dashboard_key"
# Seconds between snapshots on the event stream, and how long one snapshot serves every viewer.
UPDATE_INTERVAL_S = 0.5
SNAPSHOT_TTL_S = 0.4
CONTROL_TIMEOUT_S = 10.0

router = APIRouter()


def dashboard_authorized(path: str, headers: Mapping[str, str], query: bytes, api_key: str) -> bool:
    """Whether a dashboard route may answer without a bearer header: its cookie, or (on the page
    itself, which then sets the cookie) the key in the query."""
    if path != DASHBOARD_PATH and not path.startswith(DASHBOARD_PATH + "/"):
        return False
    cookie = SimpleCookie(headers.get("cookie", "")).get(COOKIE)
    given = cookie.value if cookie is not None else None
    if given is None and path == DASHBOARD_PATH:
        given = next(iter(parse_qs(query.decode("latin-1")).get("api_key", [])), None)
    return given is not None and hmac.compare_digest(given.encode(), api_key.encode())


class DashboardFeed:
    """Snapshots for every viewer, computed at most once per SNAPSHOT_TTL_S."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._last: tuple[float, dict[str, Any]] | None = None
        self._lock = asyncio.Lock()
        # Set when the server shuts down: open event streams end at once instead of holding the
        # graceful shutdown for its whole timeout.
        self.closing = asyncio.Event()

    async def snapshot(self) -> dict[str, Any]:
        async with self._lock:
            if self._last is not None and time.monotonic() - self._last[0] < SNAPSHOT_TTL_S:
                return self._last[1]
            snap = await asyncio.to_thread(self.build)
            self._last = (time.monotonic(), snap)
            return snap

    def build(self) -> dict[str, Any]:
        """A fresh snapshot (blocking: one control round trip per replica)."""
        engine = self.engine
        assert engine.live is not None
        snap: dict[str, Any] = {"time": time.time(), "model": engine.served_model_name}
        snap.update(engine.live.snapshot())
        try:
            result = engine.control("dashboard_state", timeout=CONTROL_TIMEOUT_S)
        except Exception as exc:  # a dead or stuck engine: the page says so and keeps polling
            return {**snap, "replicas": [], "error": str(exc)}
        if not result.ok:
            return {**snap, "replicas": [], "error": result.error}
        payloads = result.payload.get("dp_replicas") or [result.payload]
        args = engine.args
        snap["replicas"] = [
            {
                "dp_rank": rank,
                "tp_size": args.tp_size,
                "pp_size": args.pp_size,
                **payload,
                "radix_tree": self._readable(payload.get("radix_tree")),
            }
            for rank, payload in enumerate(payloads)
        ]
        return snap

    def _readable(self, node: dict[str, Any] | None) -> dict[str, Any] | None:
        """The tree with each node's preview ids decoded (ids outside the vocabulary, such as an
        image's or an adapter's keys, shown as a mark)."""
        if node is None:
            return None
        vocab = self.engine.vocab_size
        ids = node.pop("ids", [])
        words = str(self.engine.tokenizer.decode([t for t in ids if t < vocab])) if ids else ""
        if any(t >= vocab for t in ids):
            words = "▢" + words
        # A preview cut inside a multi-byte character decodes to replacement marks at its ends.
        node["text"] = words.strip("\ufffd") + ("…" if node["tokens"] > len(ids) else "")
        node["children"] = [self._readable(child) for child in node["children"]]
        return node


def _feed(request: Request) -> DashboardFeed:
    feed: DashboardFeed = request.app.state.dashboard
    return feed


@router.get(DASHBOARD_PATH, response_model=None)
async def page(request: Request) -> Response:
    key = engine_of(request).args.api_key
    if key is not None and "api_key" in request.query_params:
        # Authorized by the middleware: keep the key in a cookie, out of the address bar.
        response = RedirectResponse(DASHBOARD_PATH, status_code=303)
        response.set_cookie(COOKIE, key, httponly=True, samesite="strict", path=DASHBOARD_PATH)
        return response
    html = resources.files("radixserve.server").joinpath("static/dashboard.html").read_text("utf-8")
    return HTMLResponse(html, headers={"Cache-Control": "no-store"})


@router.get(DASHBOARD_PATH + "/snapshot")
async def snapshot(request: Request) -> JSONResponse:
    return JSONResponse(await _feed(request).snapshot())


@router.get(DASHBOARD_PATH + "/events", response_model=None)
async def events(request: Request) -> StreamingResponse:
    feed = _feed(request)

    async def stream() -> AsyncIterator[str]:
        while not feed.closing.is_set() and not await request.is_disconnected():
            yield f"data: {json.dumps(await feed.snapshot())}\n\n"
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(feed.closing.wait(), UPDATE_INTERVAL_S)

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(stream(), media_type="text/event-stream", headers=headers)


def add_dashboard(app: FastAPI, engine: Engine) -> None:
    """The dashboard's routes, only with --enable-dashboard (else they are 404s)."""
    if engine.live is None:
        return
    app.state.dashboard = DashboardFeed(engine)
    app.include_router(router)


def close_dashboard(app: Any) -> None:
    """Ends the open event streams (the server is shutting down)."""
    feed = getattr(getattr(app, "state", None), "dashboard", None)
    if isinstance(feed, DashboardFeed):
        feed.closing.set()
