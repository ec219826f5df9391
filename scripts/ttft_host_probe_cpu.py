"""The host's share of a long prompt's time to first token, on this CPU: the engine's host parts
(the front's `process`, the core's `add_request`, `schedule`, the inputs' `build` and copies, the
step's result) timed around one `generate()` of max_tokens=1, as scripts/gpu/ttft_host_probe.py
does on the GPU. The model is the shipped tiny one with its positions raised to PROMPT_LEN and
its attention replaced by the identity (the host's work is the same; the forward's is not
measured). TREE picks the checkout to import (for a before/after on one machine: a
`git worktree` of the old commit). Prints the median of RUNS runs, in ms.

    PROMPT_LEN=7680 RUNS=40 python3 scripts/ttft_host_probe_cpu.py
    TREE=/tmp/before python3 scripts/ttft_host_probe_cpu.py
"""

from __future__ import annotations

import functools
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREE = Path(os.environ.get("TREE", ROOT))
sys.path.insert(0, str(TREE))
PROMPT_LEN = int(os.environ.get("PROMPT_LEN", 7680))
RUNS = int(os.environ.get("RUNS", 40))
PARTS = [
    ("engine.input_processor", "InputProcessor", "process"),
    ("engine.engine_core", "EngineCore", "add_request"),
    ("engine.scheduler", "Scheduler", "schedule"),
    ("engine.input_builder", "InputBuilder", "build"),
    ("engine.input_builder", "BatchInputs", "to_device"),
    ("model.llama", "LlamaForCausalLM", "forward"),
    ("engine.scheduler", "Scheduler", "update_from_output"),
]


def model_folder(tmp: Path) -> Path:
    folder = tmp / "tiny"
    shutil.copytree(TREE / "llmserve" / "assets" / "tiny_model", folder)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = PROMPT_LEN + 512
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def main() -> None:
    import importlib

    from llmserve import LLM, SamplingParams
    from llmserve.model import llama

    llama.Attention.attend = lambda self, q, k, v, meta: q.reshape(q.shape[0], -1)  # host time only
    log: list[tuple[str, float, float]] = []
    state = {"on": False, "t0": 0.0}

    def timed(owner, name: str) -> None:
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if not state["on"]:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                log.append((name, 1000 * (start - state["t0"]), 1000 * (time.perf_counter() - start)))

        setattr(owner, name, wrapper)

    for module, cls, name in PARTS:
        timed(getattr(importlib.import_module(f"llmserve.{module}"), cls), name)
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(str(model_folder(Path(tmp))), max_model_len=PROMPT_LEN + 512, max_num_batched_tokens=16384)
        rng = random.Random(0)
        vocab = llm.config.model_config.arch.vocab_size
        rows = []
        for run in range(RUNS + 2):
            prompt = [rng.randrange(10, vocab) for _ in range(PROMPT_LEN)]
            log.clear()
            state.update(on=True, t0=time.perf_counter())
            llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                         use_tqdm=False)  # fmt: skip
            wall = 1000 * (time.perf_counter() - state["t0"])
            state["on"] = False
            forward = next(p for p in log if p[0] == "forward")
            row = {"host_before_forward": forward[1], "host_total": wall - forward[2]}
            for name, _, took in log:
                row.setdefault(name, took)  # the first call of each (the step's)
            if run >= 2:
                rows.append(row)
            print(
                f"run {run}: host before the forward {row['host_before_forward']:.3f} ms", file=sys.stderr, flush=True
            )
    print(f"{TREE} ({PROMPT_LEN} tokens, median of {len(rows)} runs, ms):")
    for key in ["host_before_forward", "host_total"] + [p[2] for p in PARTS if p[2] != "forward"]:
        print(f"  {key:22s} {statistics.median(r[key] for r in rows):7.3f}")


if __name__ == "__main__":
    main()
