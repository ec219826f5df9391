#!/usr/bin/env bash
# One device call (H200) that measures where time goes before changing code: attention of mixed
# steps as one launch against two (scripts/gpu/attn_mixed.py), the LoRA kernels with both expands
# (lora_kernels_check.py), the FP8 split-K GEMM's tiles at one token (fp8_gemm_micro.py, a narrow
# sweep), and the kernels of workloads (b) and (c) in FP8 by total GPU time (step_breakdown.py).
# ONLY="..." picks steps (lib.sh). Every log and JSON in $OUT.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
setup_env
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
run attn_mixed "${T_AM:-90}" python3 scripts/gpu/attn_mixed.py
run lora_kernels "${T_LK:-100}" python3 scripts/gpu/lora_kernels_check.py
TOKENS=1 SWEEP_BN=32,64,128 SWEEP_BK=128,256 SWEEP_WARPS=4 \
  run fp8_micro "${T_FM:-110}" python3 scripts/gpu/fp8_gemm_micro.py
run breakdown_fp8 "${T_BD:-200}" python3 scripts/gpu/step_breakdown.py --out "$OUT" --engine "${BD_ENGINE:-fp8}" \
  --only "${BD_ONLY:-b,c}" --no-sampler
