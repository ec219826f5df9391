"""An engine's start-up by phase on the 8B shape (bench_rows.py's `short` engine: dummy weights,
1024 seqs / 16,384 tokens), as its INFO log gives them:

    TRITON_CACHE_DIR=$(mktemp -d) python3 scripts/gpu/startup_phases.py   # a cold Triton cache
    python3 scripts/gpu/startup_phases.py                                  # the same cache, warm

Prints the engine's "start-up by phase" and warm-up lines and a RESULT line with the total and the
greedy tokens of one prompt (dummy weights are seeded: two trees' engines must give the same).
`--root DIR` imports llmserve from DIR (a tree of `ab_trees.sh prepare`)."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import bench_rows  # noqa: E402  (puts this tree first on the path)

if "--root" in sys.argv:  # then the other tree before it
    sys.path.insert(0, str(Path(sys.argv[sys.argv.index("--root") + 1]).resolve()))

logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
bench_rows.make_model_folder()
import llmserve  # noqa: E402
from llmserve import LLM, SamplingParams  # noqa: E402

print("llmserve from", Path(llmserve.__file__).parent, flush=True)
from llmserve.cli_args import engine_args_from_cli  # noqa: E402

start = time.perf_counter()
llm = LLM(**vars(engine_args_from_cli(bench_rows.bench_args("throughput", bench_rows.ENGINES["short"]))))
ready = time.perf_counter() - start
print("RESULT", json.dumps({"ready_s": round(ready, 1)}), flush=True)
# a short prompt (the paged kernel) and a fresh 1,500-token one (the fresh-prompt kernel), then decodes
prompts = [{"prompt_token_ids": list(range(100, 164))}, {"prompt_token_ids": list(range(7, 1507))}]
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
llm.shutdown()
print("RESULT", json.dumps({"tokens": [o.outputs[0].token_ids for o in outs]}), flush=True)
