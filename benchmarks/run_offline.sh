#!/usr/bin/env bash
# Thin wrapper around `radixserve bench offline`; every argument is passed through.
#   benchmarks/run_offline.sh                                # full run: W1,W2,W3 x bf16,fp32, 3 repeats
#   benchmarks/run_offline.sh --scale 0.1 --repeats 1        # smoke run, well under a minute
#   benchmarks/run_offline.sh --out bench-work/results.json  # also keep the JSON report
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -x "$repo/.venv/bin/radixserve" ]]; then
    cli="$repo/.venv/bin/radixserve"
else
    cli="radixserve"
fi
# Keep the random model under the checkout's ignored bench-work/ unless the caller picks a folder.
work_dir=("--work-dir" "$repo/bench-work")
for arg in "$@"; do
    if [[ "$arg" == --work-dir || "$arg" == --work-dir=* ]]; then
        work_dir=()
    fi
done
exec "$cli" bench offline "${work_dir[@]}" "$@"
