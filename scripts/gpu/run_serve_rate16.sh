#!/usr/bin/env bash
# Short device call: only workload (d) at 16 req/s (re-measure TTFT after the start-up warm-up).
set -uo pipefail
source "$(dirname "$0")/lib.sh"
setup_env
start_server
bench_serve 16
kill -TERM $server; wait $server
pack_out
