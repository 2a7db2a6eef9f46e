"""Engine fixtures: the transformers oracle per tiny architecture, and an engine factory whose
engines must all end idle with the KV accounting invariant holding."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from radixserve.runtime.engine import Engine
from tests.engine.oracle import GreedyOracle


@pytest.fixture(scope="session")
def oracle(tiny_model_dir: Callable[[str], Path]) -> Callable[[str], GreedyOracle]:
    cache: dict[str, GreedyOracle] = {}

    def get(arch: str) -> GreedyOracle:
        if arch not in cache:
            cache[arch] = GreedyOracle(tiny_model_dir(arch))
        return cache[arch]

    return get


@pytest.fixture
def make_engine() -> Iterator[Callable[..., Engine]]:
    """Builds engines for one test; at the end each must be idle with its KV accounting intact."""
    engines: list[Engine] = []

    def make(model_path: Path | str | None, **kwargs: Any) -> Engine:
        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("max_total_tokens", 4096)
        kwargs.setdefault("log_level", "warning")
        engine = Engine(model_path=None if model_path is None else str(model_path), **kwargs)
        engines.append(engine)
        return engine

    yield make
    try:
        for engine in engines:
            if not engine.runtime.closed:  # a test that shut one down checked it first
                engine.check_kv_invariant()
    finally:
        for engine in engines:
            engine.shutdown()
