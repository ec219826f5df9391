#!/usr/bin/env bash
# One device call (H200): offline (a) and (b) again, then workload (d): `llmserve serve` on the
# 8B shape and `llmserve bench serve`, 400 requests of 512/256 at 16 req/s and unlimited.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="$PWD:/tmp/site"
M=/tmp/llama8b
python3 -m llmserve make-random-model $M --config-only --vocab-size 128256 --hidden-size 4096 \
  --intermediate-size 14336 --num-layers 32 --num-heads 32 --num-kv-heads 8 \
  --max-position-embeddings 131072 --rope-scaling-llama3 >/dev/null
ENGINE="--model $M --load-format dummy --max-model-len 2048 --max-num-seqs 512 --max-num-batched-tokens 16384"
run() { local name=$1 limit=$2; shift 2; echo "=== $name: $*"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "exit $?" >> "$OUT/$name.log"; tail -n 3 "$OUT/$name.log"; }
run a "${T_A:-100}" python3 -m llmserve bench throughput $ENGINE --num-prompts 512 --input-len 512 --output-len 256 --output-json "$OUT/a.json"
run b "${T_B:-60}" python3 -m llmserve bench latency --model $M --load-format dummy --max-model-len 2048 --max-num-seqs 8 \
  --batch-size 1 --input-len 512 --output-len 256 --num-iters 5 --num-iters-warmup 2 --output-json "$OUT/b.json"
echo "=== d: llmserve serve $ENGINE"
python3 -m llmserve serve $ENGINE --port 8000 --log-level warning > "$OUT/server.log" 2>&1 &
server=$!
python3 - "$server" <<'PY' | tee "$OUT/server_startup.txt" || exit 1
import os, sys, time, urllib.request
pid, start = int(sys.argv[1]), time.time()
while time.time() - start < 200:
    try:
        if urllib.request.urlopen("http://127.0.0.1:8000/health", timeout=1).status == 200:
            print(f"server healthy {time.time() - start:.1f} s after launch"); sys.exit(0)
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except OSError:
        print("server died"); sys.exit(1)
    time.sleep(0.25)
print("server not healthy after 200 s"); sys.exit(1)
PY
for rate in 16 inf; do
  run "d_rate$rate" 150 python3 -m llmserve bench serve --base-url http://127.0.0.1:8000 --num-prompts 400 \
    --input-len 512 --output-len 256 --ignore-eos --request-rate $rate --vocab-size 128256 \
    --percentiles 50,90,99 --output-json "$OUT/d_rate$rate.json" --plot "$OUT/d_rate$rate.png" --disable-tqdm
  grep -E "throughput|TTFT|TPOT|ITL" "$OUT/d_rate$rate.log" | head -20
done
kill -TERM $server; wait $server
