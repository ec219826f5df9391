#!/usr/bin/env bash
# A before/after of two source trees in one device call (issue 20: "each within 2 %, noise band
# measured by repeating the before run"). Prepare here, then carry [".whl", ".ab"]:
#   bash scripts/gpu/ab_trees.sh prepare main=main branch=issue20-step-plan
# writes .ab/NAME/llmserve from each revision (git archive without the embedded model; .ab is
# git-ignored locally).
# On the device: TREES="main branch main" (the order run) and PARTS="offline serve":
#   offline: bench_rows.py --root .ab/NAME --only $ROWS (default a,b,c) on one engine per tree
#   serve:   `llmserve serve` from .ab/NAME, workload (d): 400 x 512/256 at 16 req/s, seed 201
# PRE_ROWS="a_fp8,b_fp8": rows of the working tree's code first, on the fresh machine.
# Every log and rows.json under $OUT/<i>_<name>/.
set -uo pipefail
if [ "${1:-}" = prepare ]; then
  cd "$(dirname "$0")/../.."
  grep -qx "/.ab/" .git/info/exclude 2>/dev/null || echo "/.ab/" >> .git/info/exclude
  shift; rm -rf .ab
  for spec in "$@"; do
    name=${spec%%=*} rev=${spec#*=}
    mkdir -p ".ab/$name" && git archive "$rev" llmserve ":!llmserve/assets" | tar -x -C ".ab/$name"
    echo "$name: $(git rev-parse --short "$rev") $(du -sh ".ab/$name" | cut -f1)"
  done
  exit 0
fi
source "$(dirname "$0")/lib.sh"
OUT=$(realpath "$OUT")
setup_env
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
if [ -n "${PRE_ROWS:-}" ]; then
  run pre_rows "${T_PRE:-200}" python3 scripts/gpu/bench_rows.py --out "$OUT/pre" --only "$PRE_ROWS"
fi
i=0
for name in ${TREES:-main branch main}; do
  i=$((i + 1)); tag="${i}_$name"; mkdir -p "$OUT/$tag"
  [ -d ".ab/$name/llmserve" ] || { echo "no .ab/$name/llmserve"; exit 3; }
  if [[ " ${PARTS:-offline serve} " == *" offline "* ]]; then
    run "rows_$tag" "${T_ROWS:-150}" python3 scripts/gpu/bench_rows.py --root ".ab/$name" --out "$OUT/$tag" \
      --only "${ROWS:-a,b,c}" --no-sampler-check
  fi
  if [[ " ${PARTS:-offline serve} " == *" serve "* ]]; then
    # `python3 -m` puts the working folder first on sys.path: the server starts inside the tree
    pushd ".ab/$name" > /dev/null
    PYTHONPATH="$PWD:/tmp/site" TAG="_$tag" start_server 200 && bench_serve 16 "$tag/d_rate16" 201
    kill -INT "$server" 2>/dev/null; wait "$server" 2>/dev/null
    popd > /dev/null
  fi
done
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
for folder in sorted(p for p in out.iterdir() if p.is_dir()):
    rows = json.loads((folder / "rows.json").read_text()) if (folder / "rows.json").is_file() else {}
    line = {k: v.get("output_tokens_per_s") or v.get("tpot_ms") for k, v in rows.items() if isinstance(v, dict)}
    d = folder / "d_rate16.json"
    if d.is_file():
        r = json.loads(d.read_text())
        line["d"] = {k: r.get(k) for k in ("output_throughput", "p99_ttft_ms", "median_ttft_ms", "p99_tpot_ms")}
    print("RESULT", folder.name, json.dumps(line), flush=True)
PY
