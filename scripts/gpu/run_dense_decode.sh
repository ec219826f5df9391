#!/usr/bin/env bash
# One device call (H200) for issue 18's batch-1 decode: the split-K bf16 GEMM against cuBLAS per 8B
# projection, and decode attention with the split-KV reduce fused (dense_gemm_micro.py); then the
# (b) row (ROWS) from the working tree and from the trees of `ab_trees.sh prepare` (TREES), each on
# its own engine. Carry [".whl", ".ab"]. ONLY="micro rows" picks steps. Every log and JSON in $OUT.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
OUT=$(realpath "$OUT")
setup_env
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
run micro "${T_MICRO:-260}" python3 scripts/gpu/dense_gemm_micro.py
if want rows; then
  for tree in ${TREES:-main now main}; do
    root=.; [ "$tree" = now ] || root=".ab/$tree"
    run "rows_$tree" "${T_ROWS:-120}" python3 scripts/gpu/bench_rows.py --root "$root" --out "$OUT/rows_$tree" \
      --only "${ROWS:-b}" --no-sampler-check
  done
fi
