#!/usr/bin/env bash
# Sets up (idempotent) and runs every check: ruff, strict mypy, the import-layer contracts, then the
# test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check radixserve tests benchmarks
.venv/bin/ruff format --check radixserve tests benchmarks
.venv/bin/mypy
.venv/bin/lint-imports
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
