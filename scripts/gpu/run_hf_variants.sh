#!/usr/bin/env bash
# One device call: the HF `generate()` baseline of workload (a) (512 x 512/256, 8B shape, dummy
# bf16 weights) under several transformers settings, to see which of them the issue's anchor
# (1,918 output tok/s at batch 128) matches. VARIANTS="name:extra-args ..." overrides the list.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
setup_env
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee "$OUT/versions.txt"
VARIANTS=${VARIANTS:-"sdpa_b128:--batch-size=128 eager_b128:--batch-size=128,--attn-implementation=eager sdpa_b64:--batch-size=64 sdpa_b256:--batch-size=256"}
for v in $VARIANTS; do
  name=${v%%:*}; extra=${v#*:}
  run "$name" "${T_HF:-110}" python3 -m llmserve bench hf-baseline --model $M --load-format dummy --num-prompts 512 \
    --input-len 512 --output-len 256 ${extra//,/ } --output-json "$OUT/$name.json"
done
python3 - "$OUT" <<'PY' | tee "$OUT/summary.md"
import json, pathlib, sys
print("| variant | output tok/s | batch times (s) |\n| --- | --- | --- |")
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    r = json.loads(f.read_text())
    print(f"| {f.stem} | {r['output_tokens_per_s']:,.1f} | {', '.join(f'{t:.2f}' for t in r['batch_times_s'])} |")
PY
pack_out
