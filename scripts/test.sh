#!/usr/bin/env bash
# Sets up (idempotent) and runs every check: ruff, strict mypy, the import-layer contracts, then the
# test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup_browser.sh
# The dashboard's browser test fails rather than skips here when Chromium or Playwright is missing.
export RADIXSERVE_REQUIRE_BROWSER=1
.venv/bin/ruff check radixserve radixserve_tools tests benchmarks
.venv/bin/ruff format --check radixserve radixserve_tools tests benchmarks
.venv/bin/mypy
.venv/bin/lint-imports
# --durations: the slowest tests in every log, for keeping the run inside CI's 30 minutes.
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=60 "$@"
# Without arguments, the native kernels are then tested as other CPUs run them: built for each
# narrower ISA this CPU can execute (RADIXSERVE_CPU_ISA, radixserve/kernels/native.py), the kernel
# tests, the bf16 accuracy test and calibrate's pick of the engine's matmul run again (about 2-3
# minutes on 2 cores, builds included).
if [ $# -eq 0 ]; then
    isas=$(.venv/bin/python -c "from radixserve.kernels.native import executable_isas; print(*executable_isas())")
    for isa in $isas; do
        echo "== native kernels built for $isa (RADIXSERVE_CPU_ISA=$isa)"
        RADIXSERVE_CPU_ISA=$isa .venv/bin/python -m pytest -q -p no:cacheprovider tests/kernels \
            tests/models/test_fused_decode.py \
            tests/attention/test_backends.py \
            tests/engine/test_verify_mode.py \
            tests/engine/test_smollm2_gguf.py::test_bfloat16_logits_stay_close_to_float32 \
            tests/simulator/test_peaks.py
    done
fi
