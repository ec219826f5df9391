#!/usr/bin/env bash
# One device call (H200): workload (d) at 16 req/s under three ways of scheduling the next
# step: the default (async, but not behind a step with prefill tokens while no request
# waits), async behind every step (--overlap-prefill-steps) and one step at a time
# (--no-async-scheduling). Each server gets the same seeds (the same prompts and arrival
# times; each server starts with an empty prefix cache), so the runs pair up; the default
# server also runs the unlimited rate. Steps: adaptive, always, sync (ONLY picks some).
# Results: $OUT/summary.md and $OUT/runs.tgz (every JSON and log).
set -uo pipefail
source "$(dirname "$0")/lib.sh"
setup_env
SEEDS=${SEEDS:-"101 102 103"}
serve_mode() {  # serve_mode NAME [FLAGS]
  local name=$1; want "$name" || return 0
  echo "=== $name: llmserve serve $ENGINE ${2:-}"
  SERVER_ARGS="${2:-}" TAG="_$name" start_server || { kill $server; return 1; }
  for seed in $SEEDS; do bench_serve 16 "d_rate16_${name}_$seed" "$seed"; done
  [ "$name" = adaptive ] && bench_serve inf d_rateinf_adaptive
  kill -TERM $server; wait $server
}
serve_mode adaptive
serve_mode always --overlap-prefill-steps
serve_mode sync --no-async-scheduling
python3 scripts/gpu/summary.py "$OUT"
tar czf "$OUT/runs.tgz" -C "$OUT" $(cd "$OUT" && ls *.json *.log *.txt 2>/dev/null)
