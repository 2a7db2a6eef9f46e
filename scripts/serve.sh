#!/usr/bin/env bash
# Sets up (idempotent) and runs the default model. With no arguments it completes a prompt;
# any arguments are passed to `radixserve` (e.g. `scripts/serve.sh generate "Hi" --chat`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ $# -eq 0 ]; then
  set -- generate "The capital of France is"
fi
exec .venv/bin/radixserve "$@"
