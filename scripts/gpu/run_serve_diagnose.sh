#!/usr/bin/env bash
# One device call (H200), ~3 minutes (+~3 with the mixed step): where the TTFT tail of
# workload (d) at 16 req/s comes from. Three fresh-seed runs against the default server, which
# writes its request timing log (--request-timing-log) and the engine's step log
# (--step-timing-log); `bench serve` reads /metrics (mean TTFT, queue, prefill) and keeps
# per-request detail. scripts/gpu/request_timeline.py joins both views and splits every TTFT
# into phases (client->handler->core->scheduled->first token->API->client);
# scripts/gpu/serve_stalls.py looks for stalls of every stream. The mixed step: prefill steps
# just under and over --max-mixed-graph-tokens (scripts/gpu/probe_mixed_steps.py).
# Steps: serve, timeline, stalls, mixed (ONLY picks some; default all but mixed).
# Results: $OUT/summary.md, timeline.txt, timeline.png, stalls.txt and runs.tgz (every JSON, log, plot).
set -uo pipefail
DEFAULT_STEPS="serve timeline stalls"
source "$(dirname "$0")/lib.sh"
setup_env
if want serve; then
  SERVER_ARGS="--request-timing-log $OUT/timing.jsonl --step-timing-log $OUT/steps.jsonl ${SERVER_ARGS:-}" start_server
  for i in 1 2 3; do bench_serve 16 "d_rate16_diag_$i"; done
  kill -TERM $server; wait $server
fi
want timeline && python3 scripts/gpu/request_timeline.py "$OUT/timing.jsonl" "$OUT"/d_rate16_diag_*.json \
  --steps "$OUT/steps.jsonl" --slowest 25 --plot "$OUT/timeline.png" | tee "$OUT/timeline.txt"
want stalls && python3 scripts/gpu/serve_stalls.py "$OUT"/d_rate16_diag_*.json --plot "$OUT/stalls.png" | tee "$OUT/stalls.txt"
run mixed "${T_MIXED:-200}" python3 scripts/gpu/probe_mixed_steps.py
python3 scripts/gpu/summary.py "$OUT"
pack_out timeline.txt timeline.png stalls.txt
