"""Logging setup shared by the main process and the scheduler process."""

from __future__ import annotations

import logging


def configure_logging(level: str, prefix: str = "") -> None:
    root = logging.getLogger("radixserve")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"[%(asctime)s{prefix}] %(message)s", "%H:%M:%S"))
        root.addHandler(handler)
        root.propagate = False
    root.setLevel(level.upper())
