#!/usr/bin/env bash
# One device call (H200) for issue 22: the LoRA kernels and the engine with adapters under CUDA
# graphs checked against their references (tests/gpu/test_gpu_lora.py), then on the 8B shape (scripts/gpu/bench_rows.py, one
# engine start-up per configuration): workload (a) and batch-1 latency (b) on the base model,
# (a) with 8 adapters of rank 16 (q, k, v, o, gate, up, down) taken in turn, (b) with one, and
# (a) with 64 adapters sharing 16 slots, and (a) with the expand as a cuBLAS GEMM (a_lora8g).
# ONLY="..." picks steps (lib.sh); ROWS="a,b,..." the rows. Every log and JSON in $OUT.
set -uo pipefail
DEFAULT_STEPS="lora_tests rows"
source "$(dirname "$0")/lib.sh"
setup_env
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
run lora_tests "${T_LT:-250}" python3 -m pytest tests/gpu/test_gpu_lora.py -m gpu -n 0 -p no:cacheprovider  # float32 kernels compile cold: >110 s
run rows "${T_ROWS:-330}" python3 scripts/gpu/bench_rows.py --out "$OUT" --only "${ROWS:-a,b,a_lora8,a_lora8g,b_lora,a_lora64}"
