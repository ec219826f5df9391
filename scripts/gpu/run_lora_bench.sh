#!/usr/bin/env bash
# One device call (H200) for issue 22 (and the first look at the refactored FP8 kernels): the
# LoRA kernels and the engine with adapters under CUDA graphs checked against their references,
# then workload (a) and batch-1 latency (b) on the 8B shape, the base model against 8 adapters
# of rank 16 (q, k, v, o, gate, up, down) taken in turn, and 64 adapters sharing 16 slots.
# ONLY="..." picks steps (lib.sh). Every log and JSON in $OUT.
set -uo pipefail
DEFAULT_STEPS="fp8_micro lora_kernels lora_engine a_base a_lora8 b_base b_lora a_lora64"
source "$(dirname "$0")/lib.sh"
setup_env
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
A="--num-prompts 512 --input-len 512 --output-len 256"
LG=${LORA_GRAPHS:---lora-cuda-graphs}  # LORA_GRAPHS=" " for eager LoRA steps
B="--model $M --load-format dummy --max-model-len 2048 --max-num-seqs 8 --batch-size 1 --input-len 512 --output-len 256 --num-iters 5 --num-iters-warmup 2"
run fp8_micro "${T_MICRO:-90}" python3 scripts/gpu/fp8_gemm_micro.py
run lora_kernels "${T_LK:-120}" python3 scripts/gpu/lora_kernels_check.py
run lora_engine "${T_LE:-150}" python3 scripts/gpu/lora_engine_check.py
run a_base "${T_A:-100}" python3 -m llmserve bench throughput $ENGINE $A --output-json "$OUT/a_base.json"
run a_lora8 "${T_A:-120}" python3 -m llmserve bench throughput $ENGINE $A --lora-adapters 8 --lora-rank 16 $LG --output-json "$OUT/a_lora8.json"
run b_base "${T_B:-80}" python3 -m llmserve bench latency $B --output-json "$OUT/b_base.json"
run b_lora "${T_B:-100}" python3 -m llmserve bench latency $B --lora-adapters 1 --lora-rank 16 $LG --output-json "$OUT/b_lora.json"
run a_lora64 "${T_A64:-200}" python3 -m llmserve bench throughput $ENGINE $A --lora-adapters 64 --lora-rank 16 --max-loras 16 $LG --output-json "$OUT/a_lora64.json"
grep -h "^Throughput\|Time per output token\|Median TTFT" "$OUT"/*.log
