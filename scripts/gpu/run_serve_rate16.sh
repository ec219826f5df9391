#!/usr/bin/env bash
# Short device call: only workload (d) at 16 req/s (re-measure TTFT after the start-up warm-up).
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
python3 -m llmserve serve $ENGINE --port 8000 --log-level warning > "$OUT/server.log" 2>&1 &
server=$!
python3 - "$server" <<'PY' | tee "$OUT/server_startup.txt" || exit 1
import os, sys, time, urllib.request
pid, start = int(sys.argv[1]), time.time()
while time.time() - start < 150:
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
print("server not healthy after 150 s"); sys.exit(1)
PY
grep -i "compiled\|captured" "$OUT/server.log" | head -3
timeout 90 python3 -m llmserve bench serve --base-url http://127.0.0.1:8000 --num-prompts 400 \
  --input-len 512 --output-len 256 --ignore-eos --request-rate 16 --vocab-size 128256 \
  --percentiles 50,90,99 --output-json "$OUT/d_rate16.json" --plot "$OUT/d_rate16.png" --disable-tqdm > "$OUT/d_rate16.log" 2>&1
grep -E "throughput|TTFT|TPOT|ITL|Successful|Failed" "$OUT/d_rate16.log" | head -24
kill -TERM $server; wait $server; true
