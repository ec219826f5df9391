"""An engine's start-up by phase on the 8B shape (bench_rows.py's `short` engine: dummy weights,
1024 seqs / 16,384 tokens), as its INFO log gives them:

    TRITON_CACHE_DIR=$(mktemp -d) python3 scripts/gpu/startup_phases.py   # a cold Triton cache
    python3 scripts/gpu/startup_phases.py                                  # the same cache, warm

Prints the engine's "start-up by phase" and warm-up lines and a RESULT line with the total."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import bench_rows  # noqa: E402

logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
bench_rows.make_model_folder()
from llmserve import LLM  # noqa: E402
from llmserve.cli_args import engine_args_from_cli  # noqa: E402

start = time.perf_counter()
llm = LLM(**vars(engine_args_from_cli(bench_rows.bench_args("throughput", bench_rows.ENGINES["short"]))))
ready = time.perf_counter() - start
llm.shutdown()
print("RESULT", json.dumps({"ready_s": round(ready, 1)}), flush=True)
