#!/usr/bin/env bash
# Issue 20: the Triton path on the GPU.
# `llmserve serve` directly, then `llmserve up` (gateway -> Triton -> chat model on the GPU,
# KIND_GPU), 8B shape, dummy weights: workload (d) (400 requests of 512/256) at 16 req/s and at an
# unlimited rate (RATES) against each; the platform once for each way of sending streams in
# VARIANTS. Call 6 of 2026-12-02 ran the platform alone, at 16 req/s, in about 115 s: budget
# about 120 s for each server here (start, (d) at 16 req/s and unlimited).
#
# The wheels do not fit one call (64 MiB with the tree): `bash scripts/gpu/fetch_triton_wheels.sh`
# here first, then two calls of one warm machine (it goes back 30 s after a call, so the second
# call must follow at once):
#   1. PHASE=install, carry [".whl-triton"]: pytriton into /tmp/site-triton (outside the repo, so
#      it stays for the next call while the machine is held)
#   2. PHASE=run, carry [".whl", ".whl-triton-deps"]: the rest, then the runs; every log in $OUT
# numpy 1.26 (the Python backend stub is built against numpy 1.x) is on the Triton side's path only.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
PHASE=${PHASE:-run}
if [ "$PHASE" = install ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-triton .whl-triton/*.whl
  du -sh /tmp/site-triton; ls /tmp/site-triton | head; exit 0
fi
[ -d /tmp/site-triton/pytriton ] || { echo "no /tmp/site-triton: run PHASE=install on this machine first"; exit 3; }
setup_env  # .whl into /tmp/site, the 8B config in $M
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-tdeps .whl-triton-deps/*.whl
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
PYTHONPATH="/tmp/site-tdeps:/tmp/site-triton:$PYTHONPATH" python3 -c "import tritonclient.grpc.aio, tritonclient.http, fastapi
from llmserve.triton.server import triton_home; print('imports ok;', triton_home())" || exit 4
# (d) at 16 req/s and at an unlimited rate (RATES), seed 201, against a base URL (lib.sh's bench_serve)
bench_d() {  # bench_d URL NAME
  local rate
  # NUM_PROMPTS_16: requests at 16 req/s (default 400; more for a steadier p99)
  for rate in ${RATES:-16 inf}; do
    NUM_PROMPTS=$([ "$rate" = 16 ] && echo "${NUM_PROMPTS_16:-400}" || echo 400) BASE_URL=$1 bench_serve "$rate" "$2_rate$rate" 201
  done
}
# 1. the engine directly: llmserve serve (port 8000)
if [ "${SKIP_DIRECT:-0}" != 1 ]; then
  ENGINE="--model $M --load-format dummy --max-model-len 2048 --max-num-seqs 512 --max-num-batched-tokens 16384"
  start_server 200 && bench_d http://127.0.0.1:8000 serve
  kill -INT $server 2>/dev/null; wait $server 2>/dev/null
fi
# 2. through the platform: gateway (port 9000) -> Triton -> the chat model on the GPU, once for
# each variant in $VARIANTS, "SENDS,INTERVAL[,TRANSPORT]": the chat model's stream_sends (thread | loop),
# its stub's GIL switch interval in seconds (0: Python's own, 5 ms), and how the gateway speaks to
# Triton (http, the default, or grpc: `llmserve up --triton-transport`)
for variant in ${VARIANTS:-thread,0,http thread,0,grpc}; do
  IFS=, read -r sends interval transport <<< "$variant"; transport=${transport:-http}
  extra="stream_sends: $sends"; [ "$interval" != 0 ] && extra="$extra, switch_interval_s: $interval"
  tag="${sends}_${interval}_$transport"
  printf 'models:\n  chat: {kind: chat, model_dir: %s, load_format: dummy, max_model_len: 2048, instance_kind: KIND_GPU,\n         max_num_seqs: 512, max_num_batched_tokens: 16384, %s}\n' \
    "$M" "$extra" > "$OUT/platform_$tag.yaml"
  LLMSERVE_TRITON_HIDE_MODULES=sklearn PYTHONPATH="/tmp/site-tdeps:/tmp/site-triton:$PYTHONPATH" timeout 420 \
    python3 -m llmserve up --config "$OUT/platform_$tag.yaml" --port 9000 --triton-transport "$transport" \
    --workdir "/tmp/triton-work-$tag" > "$OUT/up_$tag.log" 2>&1 &
  up=$!
  if wait_http http://127.0.0.1:9000/v1/models 300 $up platform | tee "$OUT/up_startup_$tag.txt"; then
    [ -n "${CPU_SAMPLE:-}" ] && (sleep 12; python3 scripts/gpu/proc_cpu.py 10 > "$OUT/cpu_$tag.txt") &
    bench_d http://127.0.0.1:9000 "platform_$tag"
  else
    grep -E "error|Error" /tmp/triton-work-"$tag"/*.log | head -20
  fi
  kill -INT $up 2>/dev/null; wait $up 2>/dev/null
  tail -n 60 /tmp/triton-work-"$tag"/*.log 2>/dev/null > "$OUT/triton_tail_$tag.log"
done
python3 scripts/gpu/d_summary.py "$OUT"  # RESULT lines, and every run's JSON in $OUT/d_all.json
pack_out d_all.json
