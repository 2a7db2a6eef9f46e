"""`radixserve serve`: the engine's processes behind uvicorn, supervised.

Ctrl-C and SIGTERM go to uvicorn, which stops accepting, gives open requests a few seconds, and
returns; then the engine stops its children. If a child dies, the server cannot answer anything
anymore: it prints why and exits non-zero at once rather than hang with open connections.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from types import FrameType

import uvicorn

from radixserve.config.log import configure_logging
from radixserve.config.server_args import ServerArgs
from radixserve.runtime.engine import Engine
from radixserve.server.http import create_app

logger = logging.getLogger("radixserve")

# How long open connections may take to finish after Ctrl-C / SIGTERM.
GRACEFUL_SHUTDOWN_S = 5


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
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        access_log=args.log_level.lower() == "debug",
    )
    server = uvicorn.Server(config)
    try:
        server.run()
    finally:
        engine.shutdown()
    # uvicorn returns without raising when it cannot bind the port.
    return 0 if server.started else 1
