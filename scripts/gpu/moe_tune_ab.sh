#!/usr/bin/env bash
# One device call (issues 52 and 57): the GPU tests of the fixes since the last call, then the MoE rows
# (Qwen3-30B-A3B shape, bf16) before and after `llmserve tune --only moe` wrote this card's fused-MoE
# tile tables, the GPTQ batch-1 row, each engine's decode kernels (bench_rows --profile-decode), and the
# sampler's device memory at 1,024 rows (scripts/gpu/sampler_memory.py):
#   bash scripts/gpu/moe_tune_ab.sh        (carry [".whl"])
# $OUT: summary.md, the card's tuned file, runs.tgz (every log, rows.json and kernel table).
set -u
source scripts/gpu/lib.sh
setup_env
export LLMSERVE_TUNED_DIR=/tmp/tuned  # this call's tuning alone: "before" runs on the defaults
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/card.txt"
python3 scripts/gpu/bench_rows.py --out "$OUT" --only b_moe,b_gptq --folders-only
run gpu_moe_families 60 python3 -m pytest -m gpu tests/gpu/test_gpu_moe.py -k families -n 0 -p no:cacheprovider -q -rf --timeout 100
run gpu_quant 60 python3 -m pytest -m gpu tests/gpu/test_gpu_quant_kernels.py -k "fp8_fused_moe or capture or w4a16" -n 4 -p no:cacheprovider -q -rf --timeout 90
run sampler_memory 25 python3 scripts/gpu/sampler_memory.py 1024 128256 151936
run before 140 python3 scripts/gpu/bench_rows.py --out "$OUT/before" --only b_moe,a_moe,b_gptq --no-sampler-check --profile-decode 64
run tune 150 python3 -m llmserve tune --model /tmp/qwen3_30b_a3b --only moe --moe-tokens 16,128,512,2048,16384
cp /tmp/tuned/*.json "$OUT/" 2>/dev/null
run after 95 python3 scripts/gpu/bench_rows.py --out "$OUT/after" --only b_moe,a_moe --no-sampler-check --profile-decode 64
python3 - "$OUT" <<'PY' | tee "$OUT/summary.md"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = {side: json.loads((out / side / "rows.json").read_text()) if (out / side / "rows.json").is_file() else {}
        for side in ("before", "after")}
print("| row | before | after |\n| --- | ---: | ---: |")
for name in dict.fromkeys([*rows["before"], *rows["after"]]):
    cell = lambda r: (f"{r['output_tokens_per_s']:,.0f} tok/s" if "output_tokens_per_s" in r else
                      f"{r.get('tpot_ms', 0):.3f} ms/token (TTFT {r.get('ttft_ms', 0):.1f} ms)") if r else "-"
    print(f"| {name} | {cell(rows['before'].get(name))} | {cell(rows['after'].get(name))} |")
PY
pack_out "$(basename /tmp/tuned/*.json 2>/dev/null)" card.txt sampler_memory.json
rm -rf "$OUT/before" "$OUT/after"  # (in runs.tgz: at most 8 files come back)
