#!/usr/bin/env bash
# One device call on nvidia-h200-x2: tensor parallelism. GPU correctness (TP=2 vs TP=1: tests/gpu/test_gpu_tensor_parallel.py),
# workload (a) on the 8B shape at TP=1 and TP=2, then the 70B shape served at TP=2
# (too big for one GPU in bf16: 141 GB of weights) with a short `bench serve`.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
setup_env
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
run check_tp "${T_CHECK:-150}" python3 -m pytest tests/gpu/test_gpu_tensor_parallel.py -m gpu -n 0 -p no:cacheprovider
A="--num-prompts 512 --input-len 512 --output-len 256"
run a_tp1 "${T_A1:-110}" python3 -m llmserve bench throughput $ENGINE $A --output-json "$OUT/a_tp1.json"
run a_tp2 "${T_A2:-120}" python3 -m llmserve bench throughput $ENGINE $A --tensor-parallel-size 2 --output-json "$OUT/a_tp2.json"
if ! grep -q "^exit 0" "$OUT/a_tp2.log"; then
  run a_tp2_eager "${T_A2:-120}" python3 -m llmserve bench throughput $ENGINE $A --tensor-parallel-size 2 --enforce-eager --output-json "$OUT/a_tp2_eager.json"
fi
M70=/tmp/llama70b
python3 -m llmserve make-random-model $M70 --config-only --vocab-size 128256 --hidden-size 8192 \
  --intermediate-size 28672 --num-layers 80 --num-heads 64 --num-kv-heads 8 \
  --max-position-embeddings 131072 --rope-scaling-llama3 >/dev/null
EAGER70=""
grep -q "^exit 0" "$OUT/a_tp2.log" || EAGER70="--enforce-eager"
ENGINE="--model $M70 --load-format dummy --max-model-len 2048 --max-num-seqs 256 --max-num-batched-tokens 8192 --tensor-parallel-size 2 $EAGER70"
start_server 240 && {
  timeout 120 python3 -m llmserve bench serve --base-url http://127.0.0.1:8000 --num-prompts 128 \
    --input-len 512 --output-len 128 --ignore-eos --request-rate inf --vocab-size 128256 \
    --percentiles 50,90,99 --output-json "$OUT/serve70b_tp2.json" --disable-tqdm > "$OUT/serve70b_tp2.log" 2>&1
  grep -E "throughput|TTFT|TPOT|Successful|Failed" "$OUT/serve70b_tp2.log" | head -16
  nvidia-smi --query-gpu=memory.used --format=csv,noheader | tee "$OUT/mem70b.txt"
  kill -TERM $server; wait $server
}
tail -n 20 "$OUT/server.log"
pack_out
