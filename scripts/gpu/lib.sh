# Shared by the device-call scripts: environment, the 8B-shaped model folder, the server.
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
M=/tmp/llama8b
ENGINE="--model $M --load-format dummy --max-model-len 2048 --max-num-seqs 512 --max-num-batched-tokens 16384"

# ONLY="gpu_tests a hf" runs just those steps (in the calling script's order), ONLY=all every
# step; without ONLY, the script's DEFAULT_STEPS (every step when it sets none)
want() {
  local steps=${ONLY:-${DEFAULT_STEPS:-all}}
  [ "$steps" = all ] || [[ " $steps " == *" $1 "* ]]
}
run() {  # run NAME LIMIT_S CMD...: log to $OUT/NAME.log, print its tail and RESULT lines
  local name=$1 limit=$2; shift 2; want "$name" || return 0
  echo "=== $name: $*"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "exit $?" >> "$OUT/$name.log"
  tail -n 4 "$OUT/$name.log"; grep "^RESULT" "$OUT/$name.log" || true
}

setup_env() {  # packages the GPU image lacks travel as wheels in .whl
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="$PWD:/tmp/site"
  python3 -m llmserve make-random-model $M --config-only --vocab-size 128256 --hidden-size 4096 \
    --intermediate-size 14336 --num-layers 32 --num-heads 32 --num-kv-heads 8 \
    --max-position-embeddings 131072 --rope-scaling-llama3 >/dev/null
}

wait_http() {  # wait_http URL LIMIT_S PID [LABEL]: until URL answers 200, or PID dies, or the limit
  python3 - "$1" "$2" "$3" "${4:-server}" <<'PY'
import os, sys, time, urllib.request
url, limit, pid, label, start = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4], time.time()
while time.time() - start < limit:
    try:
        if urllib.request.urlopen(url, timeout=1).status == 200:
            print(f"{label} healthy {time.time() - start:.1f} s after launch"); sys.exit(0)
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except OSError:
        print(f"{label} died"); sys.exit(1)
    time.sleep(0.25)
print(f"{label} not healthy after {limit:.0f} s"); sys.exit(1)
PY
}

start_server() {  # [LIMIT_S] sets $server; waits until /health answers 200 (prints the start-up time)
  # $SERVER_ARGS: extra engine flags; $TAG: suffix of this server's files
  python3 -m llmserve serve $ENGINE ${SERVER_ARGS:-} --port 8000 --log-level warning > "$OUT/server${TAG:-}.log" 2>&1 &
  server=$!
  wait_http http://127.0.0.1:8000/health "${1:-200}" "$server" | tee "$OUT/server_startup${TAG:-}.txt" || return 1
  grep -i "compiled\|captured" "$OUT/server${TAG:-}.log" | head -3
}

bench_serve() {  # bench_serve RATE [NAME [SEED]]: workload (d), 400 requests of 512/256 (SEED: prompts and arrivals; default fresh)
  # $BASE_URL: the server (default the one start_server starts); $NUM_PROMPTS: other than 400
  local rate=$1 name=${2:-d_rate$1} seed=${3:-}
  timeout 240 python3 -m llmserve bench serve --base-url "${BASE_URL:-http://127.0.0.1:8000}" --num-prompts "${NUM_PROMPTS:-400}" \
    --input-len 512 --output-len 256 --ignore-eos --request-rate "$rate" --vocab-size 128256 ${seed:+--seed $seed} \
    --percentiles 50,90,99 --save-detailed --output-json "$OUT/$name.json" --plot "$OUT/$name.png" \
    --disable-tqdm > "$OUT/$name.log" 2>&1
  echo "--- $name"
  grep -E "throughput|TTFT|TPOT|ITL|Successful|Failed|queue|prefill|decode|E2EL" "$OUT/$name.log" | head -36
}

pack_out() {  # pack_out [KEEP...]: at most 8 files come back from a device call, so every file in
  # $OUT goes into $OUT/runs.tgz and only runs.tgz, summary.md and the KEEP names stay beside it
  local keep=(! -name runs.tgz ! -name summary.md) name
  for name in "$@"; do keep+=(! -name "$name"); done
  # (the archive is written outside $OUT first: tar fails on a folder that changes as it reads)
  local tmp; tmp=$(mktemp /tmp/runs.XXXXXX.tgz)
  (cd "$OUT" && tar czf "$tmp" --exclude=runs.tgz . && mv "$tmp" runs.tgz && find . -maxdepth 1 -type f "${keep[@]}" -delete)
}
