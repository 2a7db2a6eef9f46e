#!/usr/bin/env bash
# The checks that need a CUDA GPU, as one script for a lent GPU machine (see benchmarks/README.md):
#   1. tests/engine/test_cuda.py: greedy fp32 on the GPU equals transformers; the hierarchical
#      cache's L2 host pool (and the file tier beside it) behind a GPU KV pool.
#   2. `radixserve bench multiturn` on the GPU: the radix cache alone against L2 (the host pool);
#      with OLD_TREE set (a directory holding another commit's radixserve/), L2 of that commit too,
#      for an A/B of a change to L2 in the same run.
#   3. benchmarks/simulator_validation.py: calibrate on the GPU, predict W1/W2/W3 and a `bench serving`
#      run, and compare the GPU's built-in profile (H100 or H200) as published.
#   4. benchmarks/gpu_step_profile.py: single-stream decode steps timed and profiled;
#   5. the same for bench multiturn's workload, the radix cache alone against L2 (where L2's cost
#      beside a GPU shows: copies, pinned allocations, synchronisations).
# Usage: OUT=results-dir [STEPS="tests multiturn validation profile l2profile"] bash benchmarks/gpu_check.sh [wheel-dir]
# The machine needs torch with CUDA and transformers; packages it lacks travel as wheels in
# wheel-dir (py3.12 manylinux: pyzmq, msgspec, gguf, xgrammar, fastapi and their needs).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:?set OUT to a directory for the logs}
WHEELS=${1:-}
PY=${PYTHON:-python3}
if [ -n "$WHEELS" ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
WORK=${WORK:-/tmp/radixserve-gpu-work}
mkdir -p "$OUT" "$WORK"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$OUT/gpu.txt"
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"

STEPS=${STEPS:-tests multiturn validation profile l2profile}
want() { [[ " $STEPS " == *" $1 "* ]]; }

if want tests; then
echo "== 1. CUDA tests"
timeout "${TESTS_TIMEOUT:-180}" $PY -m pytest -q -p no:cacheprovider tests/engine/test_cuda.py tests/cache/test_kv_copy.py tests/cache/test_host_storage.py tests/attention/test_varlen.py 2>&1 | tee "$OUT/cuda_tests.log"
fi

MODEL=$($PY -c "from pathlib import Path; from radixserve_tools.bench.model import ensure_random_llama_1b as m; print(m(Path('$WORK'), 'cuda'))")
if want multiturn; then
echo "== 2. multi-turn chats on the GPU: radix cache alone against L2"
timeout "${MULTITURN_TIMEOUT:-200}" $PY -c "from radixserve.cli import main; raise SystemExit(main())" bench multiturn \
    --model-path "$MODEL" --device cuda --settings off,host --hicache-ratio 10 --context-tokens 512 --concurrency 8 \
    --out "$OUT/multiturn.json" 2>&1 | tee "$OUT/multiturn.log"
if [ -n "${OLD_TREE:-}" ]; then
    echo "== 2b. L2 of the code in $OLD_TREE"
    PYTHONPATH=${PYTHONPATH/$PWD/$OLD_TREE} timeout "${MULTITURN_TIMEOUT:-200}" $PY -P -c "from radixserve.cli import main; raise SystemExit(main())" bench multiturn \
        --model-path "$MODEL" --device cuda --settings host --hicache-ratio 10 --context-tokens 512 --concurrency 8 \
        --out "$OUT/multiturn_old.json" 2>&1 | tee "$OUT/multiturn_old.log"
fi
fi

if want validation; then
echo "== 3. simulator validation on the GPU"
# W1-W3 and a `bench serving` run each round, as on a CPU (--serving: a server and the client
# beside the offline engine, then the server's trace replayed in process). The JSON, the serving
# traces and the server's log come back as one archive, for refits offline.
# The built-in profile of the GPU lent (H100 or H200), as published, beside the calibrated one.
HW=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -o -m1 'H100\|H200\|A100\|L4' || echo H200)
timeout "${VALIDATION_TIMEOUT:-420}" $PY benchmarks/simulator_validation.py --device cuda --model llama-1b \
    --hardware "$HW" --repeats 2 --serving --work "$WORK" 2>&1 | tee "$OUT/simulator_validation.log"
(cd "$WORK" && tar czf "$OUT/validation-work.tgz" simulator-validation.json serving-trace-*.jsonl serving-server.log serving.json 2>/dev/null)
fi

if want profile; then
echo "== 4. single-stream decode steps, timed and profiled"
timeout "${PROFILE_TIMEOUT:-150}" $PY benchmarks/gpu_step_profile.py --work "$WORK" --out "$OUT/profile" \
    --model-path "$MODEL" 2>&1 | tee "$OUT/step_profile.log"
fi

if want l2profile; then
echo "== 5. bench multiturn's workload profiled, the radix cache alone against L2"
timeout "${PROFILE_TIMEOUT:-150}" $PY benchmarks/gpu_step_profile.py --work "$WORK" --out "$OUT/l2profile" \
    --model-path "$MODEL" --multiturn 2>&1 | tee "$OUT/l2_profile.log"
fi
