#!/usr/bin/env bash
# One device call (H200): the 8B-shaped offline workloads (a) (b) (c), the engine's GPU
# correctness check, and the Hugging Face baseline. Results land in $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then  # packages the GPU image lacks (pyzmq, ...)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="$PWD:/tmp/site"
else
  export PYTHONPATH="$PWD"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
M=/tmp/llama8b
python3 -m llmserve make-random-model $M --config-only --vocab-size 128256 --hidden-size 4096 \
  --intermediate-size 14336 --num-layers 32 --num-heads 32 --num-kv-heads 8 \
  --max-position-embeddings 131072 --rope-scaling-llama3 >/dev/null
ENGINE="--model $M --load-format dummy --max-model-len 2048 --max-num-seqs ${MAX_SEQS:-512} --max-num-batched-tokens ${MAX_BATCHED:-16384}"
run() { local name=$1 limit=$2; shift 2; echo "=== $name: $*"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "exit $?" >> "$OUT/$name.log"; tail -n 4 "$OUT/$name.log"; grep "^RESULT" "$OUT/$name.log" || true; }
run a "${T_A:-130}" python3 -m llmserve bench throughput $ENGINE --num-prompts 512 --input-len 512 --output-len 256 --output-json "$OUT/a.json"
run b "${T_B:-90}" python3 -m llmserve bench latency --model $M --load-format dummy --max-model-len 2048 --max-num-seqs 8 \
  --batch-size 1 --input-len 512 --output-len 256 --num-iters 5 --num-iters-warmup 2 --output-json "$OUT/b.json"
run c "${T_C:-140}" python3 -m llmserve bench throughput $ENGINE --num-prompts 1000 --input-len 1024 --output-len 128 --output-json "$OUT/c.json"
run check "${T_CHECK:-110}" python3 scripts/gpu/check_engine.py
run hf "${T_HF:-110}" python3 -m llmserve bench hf-baseline --model $M --load-format dummy --num-prompts 512 \
  --input-len 512 --output-len 256 --batch-size 128 --output-json "$OUT/hf.json"
