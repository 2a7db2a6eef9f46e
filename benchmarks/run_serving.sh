#!/usr/bin/env bash
# W1 and W2 shapes through the HTTP server: starts `radixserve serve` on the random SmolLM2-shaped
# model (built by `radixserve bench offline` into bench-work/), runs `radixserve bench serving`
# REPEATS times per workload with the radix cache flushed before each run, then stops the server.
#   benchmarks/run_serving.sh [REPEATS] [extra serve flags...]
# Results: bench-work/serving-W{1,2}-N.json; the table of each run is printed.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cli="$repo/.venv/bin/radixserve"
repeats="${1:-3}"
shift || true
model="${MODEL_PATH:-$repo/bench-work/smollm2-135m-random-bf16}"
port="${PORT:-30123}"
url="http://127.0.0.1:$port"

"$cli" serve --model-path "$model" --port "$port" --dtype bfloat16 --max-total-tokens 40000 \
    --schedule-policy lpm --log-level warning "$@" &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null' EXIT
for _ in $(seq 300); do curl -sf "$url/health" >/dev/null && break; sleep 1; done

w1=(--dataset random --num-prompts 32 --random-input-len 256 --random-output-len 64)
w2=(--dataset generated-shared-prefix --gsp-num-groups 1 --gsp-prompts-per-group 32
    --gsp-system-prompt-len 512 --gsp-question-len 32 --gsp-output-len 32)
for name in W1 W2; do
    declare -n args="${name,,}"
    for i in $(seq "$repeats"); do
        curl -sf -X POST "$url/flush_cache" >/dev/null
        "$cli" bench serving --base-url "$url" "${args[@]}" --seed "$i" --disable-tqdm \
            --output-file "$repo/bench-work/serving-$name-$i.json"
    done
done
