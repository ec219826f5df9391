#!/usr/bin/env bash
# One device call (H200): workload (d), `llmserve serve` on the 8B shape and `llmserve bench
# serve` sending 400 requests of 512/256 (ignore_eos, a fresh seed per run) at 16 req/s and at
# an unlimited rate; then one table (scripts/gpu/summary.py; logs and JSON in $OUT/runs.tgz). ONLY="a a_sync b d" adds the
# offline (a), (a) without async scheduling and (b) first.
set -uo pipefail
DEFAULT_STEPS="d"
source "$(dirname "$0")/lib.sh"
setup_env
run a "${T_A:-100}" python3 -m llmserve bench throughput $ENGINE --num-prompts 512 --input-len 512 --output-len 256 --output-json "$OUT/a.json"
run a_sync "${T_A:-100}" python3 -m llmserve bench throughput $ENGINE --num-prompts 512 --input-len 512 --output-len 256 --no-async-scheduling --output-json "$OUT/a_sync.json"
run b "${T_B:-60}" python3 -m llmserve bench latency --model $M --load-format dummy --max-model-len 2048 --max-num-seqs 8 \
  --batch-size 1 --input-len 512 --output-len 256 --num-iters 5 --num-iters-warmup 2 --output-json "$OUT/b.json"
if want d; then
  echo "=== d: llmserve serve $ENGINE"
  start_server
  for rate in 16 inf; do
    bench_serve $rate
  done
  kill -TERM $server; wait $server
fi
python3 scripts/gpu/summary.py "$OUT"
pack_out
