#!/usr/bin/env bash
# One device call (H200), ~3 minutes per server: where the TTFT tail of workload (d) at
# 16 req/s comes from. For each server variant (VARIANTS: engine flags per server, separated
# by ';'; default: one default server), three runs (SEEDS: the same seeds on every variant
# for paired comparisons; default fresh ones). Each server writes its request timing log
# (--request-timing-log) and the engine's step log (--step-timing-log); `bench serve` reads
# /metrics (mean TTFT, queue, prefill) and keeps per-request detail.
# scripts/gpu/request_timeline.py splits every TTFT into phases (client->handler->core->
# scheduled->first token->API->client), scripts/gpu/step_times.py gives step device times by
# prefill tokens, scripts/gpu/serve_stalls.py looks for stalls of every stream. The mixed
# step: prefill steps just under and over --max-mixed-graph-tokens (probe_mixed_steps.py).
# Steps: serve, stalls, mixed (ONLY picks some; default all but mixed).
# Results: $OUT/summary.md, timeline_v*.txt, steps_v*.txt, stalls.txt and runs.tgz (all else).
set -uo pipefail
DEFAULT_STEPS="serve stalls"
source "$(dirname "$0")/lib.sh"
setup_env
IFS=';' read -r -a variants <<< "${VARIANTS:-default}"
read -r -a seeds <<< "${SEEDS:-}"
if want serve; then
  for v in "${!variants[@]}"; do
    flags=${variants[$v]}; [ "$flags" = default ] && flags=""
    echo "=== server v$v: ${flags:-(default flags)}"
    TAG=_v$v SERVER_ARGS="--request-timing-log $OUT/timing_v$v.jsonl --step-timing-log $OUT/steps_v$v.jsonl $flags" \
      start_server
    for i in 1 2 3; do bench_serve 16 "d_rate16_diag_v${v}_$i" "${seeds[$((i - 1))]:-}"; done
    kill -TERM $server; wait $server
    python3 scripts/gpu/request_timeline.py "$OUT/timing_v$v.jsonl" "$OUT"/d_rate16_diag_v${v}_*.json \
      --steps "$OUT/steps_v$v.jsonl" --slowest 25 --plot "$OUT/timeline_v$v.png" > "$OUT/timeline_v$v.txt"
    head -n 14 "$OUT/timeline_v$v.txt"
    python3 scripts/gpu/step_times.py "$OUT/steps_v$v.jsonl" --split-s 10 | tee "$OUT/steps_v$v.txt"
  done
fi
want stalls && python3 scripts/gpu/serve_stalls.py "$OUT"/d_rate16_diag_*.json --plot "$OUT/stalls.png" > "$OUT/stalls.txt"
run mixed "${T_MIXED:-200}" python3 scripts/gpu/probe_mixed_steps.py
python3 scripts/gpu/summary.py "$OUT"
pack_out stalls.txt $(cd "$OUT" && ls timeline_v*.txt steps_v*.txt 2>/dev/null)
