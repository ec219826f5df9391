#!/usr/bin/env bash
# One device call (H200): workload (d) with piecewise CUDA graphs for steps with prefill
# tokens (the default) and without them (--max-mixed-graph-tokens 0): 400 requests of 512/256
# at 16 req/s (twice with, once without) and unlimited (with). Results: $OUT/summary.md and
# $OUT/runs.tgz (every JSON, log and plot).
# Steps: piecewise, unlimited, eager (ONLY picks some).
set -uo pipefail
source "$(dirname "$0")/lib.sh"
setup_env
echo "=== d with piecewise graphs: llmserve serve $ENGINE"
if want piecewise || want unlimited; then
  start_server
  if want piecewise; then
    bench_serve 16 d_rate16_piecewise_1
    bench_serve 16 d_rate16_piecewise_2
  fi
  want unlimited && bench_serve inf d_rateinf_piecewise
  kill -TERM $server; wait $server
fi
if want eager; then
  echo "=== d without: llmserve serve $ENGINE --max-mixed-graph-tokens 0"
  SERVER_ARGS="--max-mixed-graph-tokens 0" TAG=_eager start_server
  bench_serve 16 d_rate16_eager
  kill -TERM $server; wait $server
fi
python3 scripts/gpu/summary.py "$OUT"
pack_out
