"""The HTTP server's process never imports torch: its children compute, it only tokenizes and
routes. Importing torch (directly or through AutoTokenizer's model registry) costs this process
seconds of every start, which its children, importing torch themselves, wait for on a small CPU."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from radixserve.models.source import ModelSource
from radixserve.models.tokenizer import load_tokenizer

PROBE = """
import sys
import radixserve.cli, radixserve.server.serve, radixserve.server.http
from radixserve.models.source import load_model_config, resolve_model_source
from radixserve.models.tokenizer import load_tokenizer
for spec in sys.argv[1:]:
    source = resolve_model_source(spec or None)
    load_model_config(source)
    load_tokenizer(source)("hello world")
print(sorted(m for m in ("torch", "transformers.models.auto") if m in sys.modules))
"""


def test_serving_a_checkpoint_or_the_default_gguf_imports_no_torch(
    tiny_model_dir: Callable[[str], Path], smollm2_gguf_path: Path
) -> None:
    # A GGUF's tokenizer is converted (through transformers, torch and all) once, then loaded as
    # saved: converted here first, as the first server on a fresh machine does.
    load_tokenizer(ModelSource("gguf", smollm2_gguf_path))
    # "" is the default model, the packaged SmolLM2 GGUF.
    specs = [str(tiny_model_dir("llama")), ""]
    run = subprocess.run([sys.executable, "-c", PROBE, *specs], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]", run.stdout
