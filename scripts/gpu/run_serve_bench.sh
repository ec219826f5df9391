#!/usr/bin/env bash
# One device call (H200): offline (a) and (b) again, then workload (d): `llmserve serve` on the
# 8B shape and `llmserve bench serve`, 400 requests of 512/256 at 16 req/s and unlimited.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
setup_env
run a "${T_A:-100}" python3 -m llmserve bench throughput $ENGINE --num-prompts 512 --input-len 512 --output-len 256 --output-json "$OUT/a.json"
run a_sync "${T_A:-100}" python3 -m llmserve bench throughput $ENGINE --num-prompts 512 --input-len 512 --output-len 256 --no-async-scheduling --output-json "$OUT/a_sync.json"
run b "${T_B:-60}" python3 -m llmserve bench latency --model $M --load-format dummy --max-model-len 2048 --max-num-seqs 8 \
  --batch-size 1 --input-len 512 --output-len 256 --num-iters 5 --num-iters-warmup 2 --output-json "$OUT/b.json"
want d || exit 0
echo "=== d: llmserve serve $ENGINE"
start_server
for rate in 16 inf; do
  bench_serve $rate
done
kill -TERM $server; wait $server; true
