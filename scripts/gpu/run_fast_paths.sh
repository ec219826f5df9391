#!/usr/bin/env bash
# One device call (H200) for the fast paths of issues 18/19: the sampler's two-stage argmax and
# softmax-free race against torch (sampler_check.py), attention of mixed steps in a bf16 and an
# FP8 cache (attn_mixed.py), then the benchmark rows (bench_rows.py, ROWS) and where workload (c)
# in FP8 spends its time (and fp8_large_m.py: the FP8 kernels and GEMMs at prefill sizes; fp8_vs_reference.py:
# the GPU FP8 path's greedy tokens against the CPU reference's), with the engine's step timing log (step_breakdown.py).
# ONLY="..." picks steps (lib.sh); ROWS="b_fp8,..." the rows. Every log and JSON in $OUT.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
setup_env
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
run sampler_check "${T_SC:-60}" python3 scripts/gpu/sampler_check.py
run attn_mixed "${T_AM:-90}" python3 scripts/gpu/attn_mixed.py
run fp8_large_m "${T_LM:-120}" python3 scripts/gpu/fp8_large_m.py
run rows "${T_ROWS:-290}" python3 scripts/gpu/bench_rows.py --out "$OUT" --only "${ROWS:-b_fp8,c_fp8,c_fp8kv,b,c}"
run fp8_vs_reference "${T_VR:-150}" python3 scripts/gpu/fp8_vs_reference.py
run breakdown "${T_BD:-130}" python3 scripts/gpu/step_breakdown.py --out "$OUT" --engine "${BD_ENGINE:-fp8}" \
  --only "${BD_ONLY:-c}" --no-sampler --step-log
