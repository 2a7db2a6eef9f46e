#!/usr/bin/env bash
# Sets up (idempotent) and serves the default model on http://127.0.0.1:30000 (Ctrl-C stops it).
# Any arguments are passed to `radixserve` instead, e.g. `scripts/serve.sh generate "Hi" --chat`
# or `scripts/serve.sh serve --port 8000 --api-key K`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ $# -eq 0 ]; then
  set -- serve
fi
exec .venv/bin/radixserve "$@"
