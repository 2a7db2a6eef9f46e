"""The scheduler process: startup handshake, failure reporting, and clean shutdown."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from radixserve.runtime.engine import Engine, EngineDeadError


def test_shutdown_leaves_no_process_and_no_socket_files(tiny_model_dir: Callable[[str], Path]) -> None:
    engine = Engine(str(tiny_model_dir("llama")), dtype="float32", max_total_tokens=256, log_level="warning")
    assert engine.max_total_tokens == 256
    ipc_dir = engine.runtime.ipc.path
    assert os.path.isdir(ipc_dir) and (os.stat(ipc_dir).st_mode & 0o777) == 0o700
    engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2})
    engine.check_kv_invariant()
    engine.shutdown()
    assert [child.process.returncode for child in engine.runtime.children] == [0, 0]
    assert not os.path.exists(ipc_dir)


def test_a_dead_scheduler_fails_requests_instead_of_hanging(tiny_model_dir: Callable[[str], Path]) -> None:
    engine = Engine(str(tiny_model_dir("llama")), dtype="float32", max_total_tokens=256, log_level="warning")
    try:
        engine.runtime.scheduler.kill()
        engine.runtime.scheduler.wait()
        with pytest.raises(EngineDeadError):
            engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2})
    finally:
        engine.shutdown()


def test_startup_failure_in_the_scheduler_is_reported(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir("llama"), broken)
    config = json.loads((broken / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    config["model_type"] = "gpt_neox"
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(EngineDeadError, match="GPTNeoXForCausalLM"):
        Engine(str(broken), dtype="float32", max_total_tokens=256, log_level="warning")
