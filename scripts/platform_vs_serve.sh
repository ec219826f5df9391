#!/usr/bin/env bash
# Workload through `llmserve up` (gateway -> Triton -> the chat model) and then against
# `llmserve serve` on the same model, one `llmserve bench serve` each (CPU, a tiny model):
#   .venv/bin/llmserve make-random-model /tmp/bench_rows_tiny --vocab-size 512   (once)
#   bash scripts/platform_vs_serve.sh LABEL [PLATFORM_YAML]
# RATE (40) req/s, N (300) requests of 32 tokens in and 48 out; JSON in /tmp/platform_vs_serve/.
set -uo pipefail
cd "$(dirname "$0")/.."
L=${1:?label} MODEL=${MODEL:-/tmp/bench_rows_tiny} R=${RATE:-40} N=${N:-300} O=/tmp/platform_vs_serve
mkdir -p $O
YAML=${2:-$O/platform.yaml}
[ -n "${2:-}" ] || printf 'models:\n  chat: {kind: chat, model_dir: %s, max_model_len: 512, max_num_seqs: 128}\n' "$MODEL" > "$YAML"
BENCH="--num-prompts $N --input-len 32 --output-len 48 --ignore-eos --request-rate $R --seed 7 --percentiles 50,99 --disable-tqdm --vocab-size 512"
wait_ok() { for _ in $(seq 1 180); do curl -sf "$1" >/dev/null && return 0; sleep 1; done; return 1; }
.venv/bin/llmserve up --config "$YAML" --port 9100 --triton-http-port 9101 --triton-grpc-port 9102 \
  --triton-metrics-port 9103 --workdir "$O/work_$L" > "$O/up_$L.log" 2>&1 &
up=$!
wait_ok localhost:9100/v1/models && .venv/bin/llmserve bench serve --base-url http://127.0.0.1:9100 --model chat $BENCH \
  --output-json "$O/platform_$L.json" > "$O/bench_platform_$L.log" 2>&1
kill -INT $up; wait $up
.venv/bin/llmserve serve --model "$MODEL" --max-model-len 512 --max-num-seqs 128 --port 9200 --log-level warning > "$O/serve_$L.log" 2>&1 &
sv=$!
wait_ok localhost:9200/health && .venv/bin/llmserve bench serve --base-url http://127.0.0.1:9200 $BENCH \
  --output-json "$O/serve_$L.json" > "$O/bench_serve_$L.log" 2>&1
kill -INT $sv; wait $sv
.venv/bin/python - "$L" "$O" <<'PY'
import json, sys
label, out = sys.argv[1:]
for kind in ("platform", "serve"):
    d = json.load(open(f"{out}/{kind}_{label}.json"))
    print(label, kind, {k: round(d[k], 2) for k in ("completed", "failed", "output_throughput", "median_ttft_ms",
                                                   "p99_ttft_ms", "median_tpot_ms", "median_itl_ms")})
PY
