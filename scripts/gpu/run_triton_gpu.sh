#!/usr/bin/env bash
# Issue 20: the Triton path on the GPU.
# `llmserve up` (gateway -> Triton -> chat model on the GPU, KIND_GPU) with the 8B shape (dummy
# weights), workload (d) through the gateway (400 requests of 512/256 at 16 req/s), then the same
# against `llmserve serve` directly in the same call: output tok/s and TTFT p99 side by side.
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
cat > "$OUT/platform.yaml" <<EOF
models:
  chat: {kind: chat, model_dir: $M, load_format: dummy, max_model_len: 2048, instance_kind: KIND_GPU,
         max_num_seqs: 512, max_num_batched_tokens: 16384}
EOF
# 1. through the platform: gateway (port 9000) -> Triton -> the chat model on the GPU
LLMSERVE_TRITON_HIDE_MODULES=sklearn PYTHONPATH="/tmp/site-tdeps:/tmp/site-triton:$PYTHONPATH" timeout 420 python3 -m llmserve up --config "$OUT/platform.yaml" \
  --port 9000 --workdir /tmp/triton-work > "$OUT/up.log" 2>&1 &
up=$!
platform_ok=0
if wait_http http://127.0.0.1:9000/v1/models 300 $up platform | tee "$OUT/up_startup.txt"; then
  platform_ok=1
  timeout 150 python3 -m llmserve bench serve --base-url http://127.0.0.1:9000 --num-prompts 400 --input-len 512 \
    --output-len 256 --ignore-eos --request-rate 16 --vocab-size 128256 --seed 201 --percentiles 50,90,99 \
    --output-json "$OUT/d_platform.json" --disable-tqdm > "$OUT/d_platform.log" 2>&1
  grep -E "throughput|TTFT|Successful|Failed" "$OUT/d_platform.log" | head -12
fi
kill -INT $up 2>/dev/null; wait $up 2>/dev/null
tail -n 60 /tmp/triton-work/*.log 2>/dev/null > "$OUT/triton_tail.log"
[ "${SKIP_DIRECT:-0}" = 1 ] && { pack_out d_platform.json; exit 0; }
[ $platform_ok = 1 ] || { grep -E "error|Error" /tmp/triton-work/*.log | head -20; pack_out; exit 5; }
# 2. the same engine directly: llmserve serve (port 8000)
ENGINE="--model $M --load-format dummy --max-model-len 2048 --max-num-seqs 512 --max-num-batched-tokens 16384"
start_server 200 && bench_serve 16 d_serve 201
kill -INT $server 2>/dev/null; wait $server 2>/dev/null
pack_out d_platform.json d_serve.json
