"""Where radixserve keeps files between runs (the built kernels, converted tokenizers)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(kind: str, override_env: str) -> Path:
    """$override_env when set, else $XDG_CACHE_HOME/radixserve/<kind> (~/.cache by default)."""
    configured = os.environ.get(override_env)
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "radixserve" / kind
