"""Every `llmserve bench serve` JSON named *_rate*.json in a folder: one RESULT line each, and their
summaries (not the per-request lists) in d_all.json there (scripts/gpu/run_triton_gpu.sh).

    python3 scripts/gpu/d_summary.py $OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

KEYS = ("completed", "failed", "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
        "p99_tpot_ms", "median_itl_ms")  # fmt: skip


def main(folder: Path) -> None:
    runs = {f.stem: json.loads(f.read_text()) for f in sorted(folder.glob("*_rate*.json"))}
    for name, run in runs.items():
        row = {k: round(run[k], 2) if isinstance(run.get(k), float) else run.get(k) for k in KEYS}
        print("RESULT", name, json.dumps(row), flush=True)
    # the summaries only: each run's per-request lists stay in its own JSON (runs.tgz)
    scalars = {name: {k: v for k, v in run.items() if not isinstance(v, list)} for name, run in runs.items()}
    (folder / "d_all.json").write_text(json.dumps(scalars, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
