#!/usr/bin/env bash
# One device call (H200) with every row of issue 18: the batch-1 GEMMs against cuBLAS
# (dense_gemm_micro.py, SWEEP=0 TOKENS=1), then bench_rows.py on the working tree (ROWS: greedy,
# top-k/top-p, presence, repetition, shared prefix, (c), (b), 64 x 7,680, TTFT at 7,680 / 16k / 32k),
# then BEFORE_ROWS from the tree of `ab_trees.sh prepare main=REV` (carry [".whl", ".ab"]), then the
# GPU time of (b) by kind (step_breakdown.py). The rows include sampling beyond the issue's table:
# top-p alone, seeded top-p, the OpenAI mix, top-5 logprobs, a batch of five kinds of request (mixed).
# `chain`: one decode step's kernels in a CUDA graph with and without PDL (pdl_chain_micro.py); `nopdl`: NOPDL_ROWS with LLMSERVE_PDL=0 (same tree).
# `checks`: the kernels against their references (bench_kernels.py --only checks --quick).
# `chunks`: a prompt's later chunk by the kernel and by SDPA over its whole sequence (bench_kernels.py
# --only chunks); `probe`: one batch-1 TTFT at PROBE_LEN tokens (default 7,680) under the profiler,
# with the host's share (probe_ttft.py).
# `overlap`: one decode step of (a) with two half batches on two streams (overlap_micro.py).
# ONLY="checks chunks micro chain overlap rows nopdl before breakdown probe" picks steps.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
OUT=$(realpath "$OUT")
setup_env
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
run checks "${T_CHECKS:-90}" python3 scripts/gpu/bench_kernels.py --only checks --quick
mkdir -p "$OUT/chunks"; OUT=$OUT/chunks run chunks "${T_CHUNKS:-90}" python3 scripts/gpu/bench_kernels.py --only chunks --budget-s 80
SWEEP=0 TOKENS=1 run micro "${T_MICRO:-60}" python3 scripts/gpu/dense_gemm_micro.py
run chain "${T_CHAIN:-120}" python3 scripts/gpu/pdl_chain_micro.py
run overlap "${T_OVERLAP:-120}" python3 scripts/gpu/overlap_micro.py
run rows "${T_ROWS:-330}" python3 scripts/gpu/bench_rows.py --out "$OUT/now" \
  --only "${ROWS:-b,a,topp,presence,repetition,topp_only,seeded,openai,logprobs,mixed,prefix,c,long64,ttft7680,ttft16k,ttft32k}"
LLMSERVE_PDL=0 run nopdl "${T_NOPDL:-90}" python3 scripts/gpu/bench_rows.py --out "$OUT/nopdl" \
  --only "${NOPDL_ROWS:-b}" --no-sampler-check
if [ -d .ab/main/llmserve ]; then
  run before "${T_BEFORE:-90}" python3 scripts/gpu/bench_rows.py --root .ab/main --out "$OUT/before" \
    --only "${BEFORE_ROWS:-b}" --no-sampler-check
fi
run breakdown "${T_BD:-60}" python3 scripts/gpu/step_breakdown.py --out "$OUT" --only "${BD_ONLY:-b}" --no-sampler
PROMPT_LEN=${PROBE_LEN:-7680} MAX_LEN=$(( ${PROBE_LEN:-7680} + 512 )) run probe "${T_PROBE:-120}" python3 scripts/gpu/probe_ttft.py
