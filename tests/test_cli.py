from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path


def test_generate_prints_a_completion(tiny_model_dir: Callable[[str], Path]) -> None:
    cmd = [
        sys.executable, "-m", "radixserve.cli", "generate", "def main():",
        "--model-path", str(tiny_model_dir("llama")), "--dtype", "float32", "--max-total-tokens", "256",
        "--max-new-tokens", "3", "--json", "--log-level", "warning",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert len(result["output_ids"]) == 3
    assert result["meta_info"]["finish_reason"]["type"] in ("length", "stop")


def test_bad_flag_values_are_rejected_with_a_message() -> None:
    cmd = [sys.executable, "-m", "radixserve.cli", "generate", "x", "--page-size", "0"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2
    assert "radixserve: error: --page-size must be >= 1" in done.stderr
    assert "Traceback" not in done.stderr
