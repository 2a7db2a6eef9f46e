"""`radixserve serve`: the engine's processes behind uvicorn, supervised.

Ctrl-C and SIGTERM go to uvicorn, which closes the listening socket at once (new connections are
refused) and lets the requests in flight finish. After --graceful-shutdown-timeout those still
running are aborted: each ends with finish reason "abort" and a message saying why, its answer is
sent, and uvicorn returns; then the engine stops its children. A second Ctrl-C quits at once. If a
child dies, the server cannot answer anything anymore: it prints why and exits non-zero at once
rather than hang with open connections.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import sys
from types import FrameType

import uvicorn

from radixserve.config.log import configure_logging
from radixserve.config.server_args import ServerArgs
from radixserve.runtime.engine import Engine
from radixserve.server.dashboard import close_dashboard
from radixserve.server.http import create_app

logger = logging.getLogger("radixserve")

# After the requests in flight are aborted, how long their answers may take to reach the clients.
ABORTED_ANSWERS_S = 5.0


class DrainingServer(uvicorn.Server):
    """uvicorn's server, which on shutdown aborts the requests still running once the grace period
    has passed, so that every client gets an answer with a finish reason instead of a cut stream."""

    def __init__(self, config: uvicorn.Config, engine: Engine, grace_s: float):
        super().__init__(config)
        self.engine = engine
        self.grace_s = grace_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.engine.num_in_flight:
            logger.info(
                "draining %d requests in flight for up to %g s (--graceful-shutdown-timeout)",
                self.engine.num_in_flight,
                self.grace_s,
            )
        close_dashboard(self.config.app)
        timer = asyncio.get_running_loop().call_later(self.grace_s, self._abort_in_flight)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            print(ready_banner(self.engine, self.config.host, self.config.port), flush=True)

    def _abort_in_flight(self) -> None:
        if not self.engine.num_in_flight:
            return
        logger.warning(
            "aborting %d requests still running after --graceful-shutdown-timeout %g s",
            self.engine.num_in_flight,
            self.grace_s,
        )
        message = f"the server is shutting down (--graceful-shutdown-timeout {self.grace_s:g} s passed)"
        self.engine.abort(abort_all=True, message=message)


def ready_banner(engine: Engine, host: str, port: int) -> str:
    """What `serve` prints once it answers: where, and a request to paste."""
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    base = f"http://[{shown}]:{port}" if ":" in shown else f"http://{shown}:{port}"
    body = json.dumps(
        {"model": engine.served_model_name, "messages": [{"role": "user", "content": "Hello!"}]}
    )
    auth = " -H 'Authorization: Bearer <your --api-key>'" if engine.args.api_key else ""
    lines = [
        f"radixserve is ready at {base} (model {engine.served_model_name})",
        f"  curl {base}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'",
    ]
    if engine.live is not None:
        lines.append(f"  dashboard: {base}/dashboard" + ("?api_key=<your --api-key>" if auth else ""))
    return "\n".join(lines)


def serve(args: ServerArgs) -> int:
    configure_logging(args.log_level)
    if args.node_rank > 0:
        from radixserve.runtime.worker_node import serve_worker_node

        return serve_worker_node(args)
    engines: list[Engine] = []

    def on_fatal(error: str) -> None:
        print(
            f"radixserve: a child process stopped, so the server exits:\n{error}", file=sys.stderr, flush=True
        )
        for engine in engines:
            engine.runtime.stop_children()
        os._exit(1)

    def stop_startup(sig: int, frame: FrameType | None) -> None:
        # Unwinds Engine startup, which then stops the children it started.
        raise SystemExit(128 + sig)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop_startup)
    engine = Engine(**args.to_dict(), on_fatal=on_fatal)
    engines.append(engine)
    # uvicorn handles these while it runs, then restores these handlers and re-raises the signal
    # it got; the handlers take note instead of killing us, so the engine below stops cleanly.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda sig, frame: logger.info("stopping on signal %d", sig))
    config = uvicorn.Config(
        create_app(engine),
        host=args.host,
        port=args.port,
        log_level=args.log_level.lower(),
        # uvicorn's own limit, after which it cancels what still runs: ours comes first.
        timeout_graceful_shutdown=int(args.graceful_shutdown_timeout + ABORTED_ANSWERS_S + 1),
        access_log=args.log_level.lower() == "debug",
    )
    server = DrainingServer(config, engine, args.graceful_shutdown_timeout)
    try:
        server.run()
    finally:
        engine.shutdown()
    # uvicorn returns without raising when it cannot bind the port.
    return 0 if server.started else 1
