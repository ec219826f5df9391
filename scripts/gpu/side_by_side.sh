#!/usr/bin/env bash
# llmserve and vLLM 0.25 on the same bench_rows.py rows in one device call, then the ratio table:
#   bash scripts/gpu/side_by_side.sh a_moe,b_moe,c_moe [OURS_LIMIT_S VLLM_LIMIT_S]
# vLLM must be unpacked at /root/vllm_site (../shared/vllm/README.md); the wheels in .whl (setup_env).
# Writes $OUT/rows.json (llmserve), $OUT/vllm_rows.json, $OUT/compare.md and both logs.
set -u
ROWS=$1; OURS_LIMIT=${2:-300}; VLLM_LIMIT=${3:-300}
source scripts/gpu/lib.sh
if [ -d /tmp/site/fastapi ]; then export PYTHONPATH="$PWD:/tmp/site"; else setup_env; fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/card.txt"
python3 scripts/gpu/bench_rows.py --out "$OUT" --only "$ROWS" --folders-only
echo "=== llmserve $(git rev-parse --short HEAD 2>/dev/null)"
timeout "$OURS_LIMIT" python3 scripts/gpu/bench_rows.py --out "$OUT" --only "$ROWS" --no-sampler-check \
  > "$OUT/ours.log" 2>&1; echo "exit $?"; grep -E "^RESULT|Error|error:" "$OUT/ours.log" | head -40
echo "=== vLLM"
PYTHONPATH=/root/vllm_site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_USE_FLASHINFER_SAMPLER=0 \
  timeout "$VLLM_LIMIT" python3 scripts/gpu/vllm_rows.py --out "$OUT" --only "$ROWS" > "$OUT/vllm.log" 2>&1
echo "exit $?"; grep -E "^RESULT|Error|error:" "$OUT/vllm.log" | head -40
python3 scripts/gpu/vllm_rows.py --compare "$OUT/rows.json" "$OUT/vllm_rows.json" | tee "$OUT/compare.md"
