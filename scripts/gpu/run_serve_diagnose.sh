#!/usr/bin/env bash
# One device call (H200), ~6 minutes: where the TTFT tail of workload (d) at 16 req/s comes
# from. Three fresh-seed runs against the default server, each with the server's own view
# (`bench serve` reads /metrics: mean TTFT, queue and prefill time) and per-request detail
# (read by scripts/gpu/serve_stalls.py here); then prefill steps just under and over
# --max-mixed-graph-tokens, eager and with piecewise graphs up to 2048
# (scripts/gpu/probe_mixed_steps.py). Steps: serve, stalls, mixed (ONLY picks some).
# Results: $OUT/summary.md, $OUT/stalls.txt, $OUT/stalls.png and $OUT/runs.tgz (every JSON, log, plot).
set -uo pipefail
source "$(dirname "$0")/lib.sh"
setup_env
if want serve; then
  start_server
  for i in 1 2 3; do bench_serve 16 "d_rate16_diag_$i"; done
  kill -TERM $server; wait $server
fi
want stalls && python3 scripts/gpu/serve_stalls.py "$OUT"/d_rate16_diag_*.json --plot "$OUT/stalls.png" | tee "$OUT/stalls.txt"
run mixed "${T_MIXED:-200}" python3 scripts/gpu/probe_mixed_steps.py
python3 scripts/gpu/summary.py "$OUT"
pack_out stalls.txt stalls.png
